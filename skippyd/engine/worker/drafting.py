"""Speculative decoding on stage 0: drafts ride as extra rows of the shared batch.

Before a plan runs, each decoding request that speculates may get a few drafted tokens
after its pending one: from its own text (``ngram``: :mod:`~skippyd.engine.policy.ngram`)
or from a small draft model (``draft``: :class:`DraftModel`). How many is the policy's
call (:class:`~skippyd.engine.policy.draft_length.DraftControl`): only as many as its
acceptance so far makes worth a row's cost on this machine. The runtime verifies them in
the same ``llama_decode`` as everyone else's rows and returns the tokens accepted; the
worker learns from the outcome. ``docs/scheduler.md``, *Speculative decoding*, has the
rules. Worker thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skippyd.engine.policy import IterationPhase, IterationPlan
from skippyd.engine.policy.draft_length import DraftControl, DraftStats
from skippyd.engine.policy.ngram import NgramIndex
from skippyd.engine.policy.step_budget import StepCostModel
from skippyd.engine.runtime.contract import (
    GREEDY,
    IterationRequest,
    RowPhase,
    Runtime,
    RuntimeFailure,
)

if TYPE_CHECKING:
    from skippyd.engine.worker.record import Generation

logger = logging.getLogger(__name__)

#: ``[speculative] mode`` values.
MODES = ("off", "ngram", "draft")


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """What ``[speculative]`` asks for."""

    mode: str = "off"
    """``off``, ``ngram`` (drafts from the request's own text) or ``draft`` (a model)."""
    min_draft: int = 2
    """Fewest drafts a row carries when it carries any."""
    max_draft: int = 16
    """Most drafts a row carries."""
    split_by_sequence: bool = False
    """The runtime computes a batch in micro-batches of equal rows per sequence (a KV
    stream per lane): drafts beside another sequence's rows add a micro-batch, a whole
    pass over the weights, so drafts ride only on a step's lone row."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(slots=True)
class RequestDrafts:
    """What speculation keeps of one request (on its record)."""

    stats: DraftStats
    index: NgramIndex | None = None
    """The request's own tokens, indexed for ``ngram`` drafts."""
    source: int = 0
    """How its last drafts were found (the n-gram length that matched; 0: a model)."""


class Speculation:
    """Attaches drafts to plans and learns from their outcomes; see the module docstring.

    Args:
        settings: The stage's ``[speculative]`` settings.
        max_session_tokens: Most tokens a session may hold (drafts must fit).
        draft_model: The draft model of ``draft`` mode.
        control: Decides draft lengths (one for ``settings`` if None).
    """

    def __init__(self, settings: SpeculationSettings, max_session_tokens: int,
                 draft_model: DraftModel | None = None,
                 control: DraftControl | None = None) -> None:
        if settings.mode not in MODES:
            raise ValueError(f"speculative mode: one of {', '.join(MODES)} (got {settings.mode!r})")
        if settings.mode == "draft" and draft_model is None:
            raise ValueError("speculative mode 'draft' needs a draft model")
        self.settings = settings
        self.control = control or DraftControl(settings.min_draft, settings.max_draft)
        self._max_session_tokens = max_session_tokens
        self._draft_model = draft_model
        self.num_drafted = 0
        """Drafts verified, over every request."""
        self.num_accepted = 0
        """Drafts accepted, over every request."""

    @property
    def mode(self) -> str:
        return self.settings.mode

    def admit(self, gen: Generation) -> None:
        """Give a new request its drafting record, unless it opted out."""
        if self.settings.enabled and gen.request.speculative and gen.drafts is None:
            gen.drafts = RequestDrafts(
                self.control.new_stats(),
                index=NgramIndex() if self.settings.mode == "ngram" else None)

    def attach(self, plan: IterationPlan, requests: dict[str, Generation],
               budget: int, fallback: StepCostModel | None) -> IterationPlan:
        """``plan`` with drafts on the decode rows where they are expected to pay.

        An n-gram draft is found first and its length then chosen from what drafts found
        the same way get; a draft model's drafts cost a model call each, so their length
        is chosen first.

        Args:
            plan: The plan the policy made.
            requests: The worker's records, by id.
            budget: Most rows the plan may hold.
            fallback: Step costs the policy learned from every step.
        """
        if not self.settings.enabled:
            return plan
        if self.settings.split_by_sequence and len(plan.work) > 1:
            return plan
        decode_rows = sum(1 for w in plan.work if w.phase is IterationPhase.DECODE)
        room = budget - plan.token_count
        chosen: dict[int, tuple[int, ...]] = {}
        wanted: dict[int, tuple[Generation, int]] = {}
        for index, work in enumerate(plan.work):
            if room < self.settings.min_draft:
                break
            gen = requests.get(work.sequence_id)
            if (work.phase is not IterationPhase.DECODE or not work.sample_last or gen is None
                    or gen.drafts is None or gen.sequence is None):
                continue
            sequence, drafts = gen.sequence, gen.drafts
            limit = min(room, sequence.max_tokens - len(sequence.generated_tokens) - 1,
                        self._max_session_tokens - work.positions[0] - 1,
                        self.settings.max_draft)
            if limit < self.settings.min_draft:
                continue
            proposal: tuple[int, ...] = ()
            if drafts.index is not None:
                index_tokens(drafts.index, sequence.prompt_tokens, sequence.generated_tokens)
                proposal, drafts.source = drafts.index.propose(limit)
                limit = len(proposal)
            rows = plan.token_count + (budget - plan.token_count - room)
            length = self.control.draft_length(
                self.control.chances(drafts.stats, drafts.source), decode_rows, rows,
                limit, fallback, stats=drafts.stats)
            if not length:
                continue
            room -= length
            if drafts.index is not None:
                chosen[index] = proposal[:length]
            else:
                wanted[index] = (gen, length)
        if wanted and self._draft_model is not None:
            chosen.update(self._draft_model.propose(wanted))
        chosen = {index: draft for index, draft in chosen.items()
                  if len(draft) >= self.settings.min_draft}
        return plan.with_drafts(chosen) if chosen else plan

    def record(self, gen: Generation, drafted: int, accepted: int) -> None:
        """Learn that ``accepted`` of the ``drafted`` drafts of ``gen``'s row were kept."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        if gen.drafts is not None:
            self.control.record(gen.drafts.stats, gen.drafts.source, drafted, accepted)

    def observe(self, plan: IterationPlan, elapsed_s: float,
                requests: dict[str, Generation]) -> None:
        """Learn from a step that ran: its cost, and which speculating rows had no drafts."""
        if not self.settings.enabled:
            return
        self.control.observe(plan, elapsed_s)
        for work in plan.work:
            if work.phase is IterationPhase.DECODE and not work.draft:
                gen = requests.get(work.sequence_id)
                if gen is not None and gen.drafts is not None:
                    self.control.note_plain_step(gen.drafts.stats, 1)

    def forget(self, gen: Generation) -> None:
        """``gen`` left: free what drafting kept for it."""
        if self._draft_model is not None and gen.drafts is not None:
            self._draft_model.drop(gen.id)


def index_tokens(index: NgramIndex, prompt: tuple[int, ...], generated: list[int]) -> None:
    """Bring ``index`` up to the request's tokens (prompt, then generated)."""
    have = len(index)
    if have < len(prompt):
        index.extend(prompt[have:])
        have = len(prompt)
    index.extend(generated[have - len(prompt):])


class DraftModel:
    """A small model that drafts for stage 0, in its own llama.cpp context.

    Each speculating request has a session in it that follows the request's text; before
    drafting, what the target accepted since is fed to it, then it decodes the drafts
    greedily, all requests of the step in one call per draft token. Worker thread only.

    Args:
        runtime: The draft model's runtime (its lanes at least the stage's).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._chunk = max(1, runtime.max_batch_tokens)

    def propose(self, wanted: dict[int, tuple[Generation, int]]) -> dict[int, tuple[int, ...]]:
        """Greedy drafts of up to the asked length per work index; empty where the draft
        model fails (a draft is only ever a guess)."""
        try:
            return self._propose(wanted)
        except RuntimeFailure as exc:
            logger.warning("draft model failed, drafting nothing this step: %s", exc)
            for gen, _ in wanted.values():
                self.drop(gen.id)
            return {}

    def _propose(self, wanted: dict[int, tuple[Generation, int]]) -> dict[int, tuple[int, ...]]:
        runtime = self.runtime
        texts: dict[int, list[int]] = {}
        for index, (gen, _) in wanted.items():
            assert gen.sequence is not None
            texts[index] = [*gen.sequence.prompt_tokens, *gen.sequence.generated_tokens]
        # Catch up: every token before the pending one, where the session's KV differs.
        for index, text in texts.items():
            session = wanted[index][0].id
            held = runtime.session_history(session)
            common = _common_prefix(held, text[:-1])
            if common < len(held):
                runtime.trim_session(session, common)
            for start in range(common, len(text) - 1, self._chunk):
                runtime.run_iteration([IterationRequest(
                    session, text[start:min(start + self._chunk, len(text) - 1)],
                    positions=range(start, min(start + self._chunk, len(text) - 1)))])
        drafts: dict[int, list[int]] = {index: [] for index in wanted}
        last = {index: text[-1] for index, text in texts.items()}
        longest = max(limit for _, limit in wanted.values())
        for step in range(longest):
            going = [index for index, (_, limit) in wanted.items() if step < limit]
            requests = [IterationRequest(wanted[index][0].id, [last[index]],
                                         sampling=GREEDY, sample_last=True,
                                         phase=RowPhase.DECODE) for index in going]
            output = runtime.run_iteration(requests)
            for sample in output.samples:
                index = going[sample.request_index]
                if sample.is_eog:
                    wanted[index] = (wanted[index][0], step)  # no draft beyond an end
                    continue
                drafts[index].append(sample.token)
                last[index] = sample.token
        return {index: tuple(tokens) for index, tokens in drafts.items()}

    def drop(self, session_id: str) -> None:
        try:
            self.runtime.drop_session(session_id)
        except RuntimeFailure as exc:
            logger.warning("dropping draft session %s failed: %s", session_id, exc)

    def close(self) -> None:
        self.runtime.close()


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
