"""Building the works of one iteration.

These functions advance the prefill cursors of the sequences they plan; the scheduler
calls them on its admitted sequences, always in sorted-id order so that identical
inputs give identical plans.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from skippyd.engine.policy.config import SchedulerConfig
from skippyd.engine.policy.plan import (
    IterationPhase,
    IterationPlan,
    IterationWork,
)
from skippyd.engine.policy.sequence import ScheduledSequence
from skippyd.engine.policy.step_budget import CHUNK_OVERRUN, EFFICIENT_PREFILL_TOKENS

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PlanDraft:
    """Work being assembled for one iteration, with its remaining token budget."""

    budget: int
    work: list[IterationWork]
    prefill_sequences: int = 0

    def add_decode(self, sequence: ScheduledSequence) -> None:
        """Emit the pending token of a caught-up sequence at the next position.

        The cursor moves one past the replay length: the decoded token now occupies that
        position, so an uninterrupted sequence never replays it.
        """
        token = sequence.pending_decode_token()
        if token is None:
            raise RuntimeError(f"decode planned for {sequence.id!r} without a pending token")
        position = sequence.recompute_token_count()
        self.work.append(IterationWork(
            sequence_id=sequence.id,
            tokens=(token,),
            positions=(position,),
            sample_last=True,
            phase=IterationPhase.DECODE,
            sampling=sequence.sampling,
        ))
        sequence.prefill_cursor = position + 1
        self.budget -= 1

    def add_prefill_chunk(self, sequence: ScheduledSequence, chunk_tokens: int,
                          sample_tail: int = 0) -> None:
        """Emit the next prompt/recompute chunk of a sequence that still needs replay.

        Only a prefill that reaches the end of the prompt samples; recompute never does,
        because its pending decode token already exists. With ``sample_tail`` a prompt
        whose rest is at least twice that long stops that many tokens short of its end,
        which a later chunk of its own samples (``SchedulerConfig.sample_tail_tokens``);
        the tokens held back stay spent in this plan (handed to another prompt they would
        make a chunk of a few tokens).
        """
        replay_len = sequence.recompute_token_count()
        start = sequence.prefill_cursor
        count = min(chunk_tokens, max(0, replay_len - start), self.budget)
        spent = count
        generated = bool(sequence.generated_tokens)
        if (sample_tail > 0 and not generated and start + count == replay_len
                and replay_len - start >= 2 * sample_tail):
            count = replay_len - sample_tail - start
        self.work.append(IterationWork(
            sequence_id=sequence.id,
            tokens=sequence.replay_slice(start, start + count),
            positions=tuple(range(start, start + count)),
            sample_last=(start + count == replay_len) and not generated,
            phase=IterationPhase.RECOMPUTE if generated else IterationPhase.PREFILL,
            sampling=sequence.sampling,
        ))
        sequence.prefill_cursor = start + count
        self.prefill_sequences += 1
        self.budget -= spent


def plan_phase_homogeneous(
    sequences: Sequence[ScheduledSequence], config: SchedulerConfig, consecutive_prefill: int
) -> tuple[list[IterationWork], int]:
    """Plan either prompt work or decode work, never both.

    Prompt work runs first unless live decoders have already waited
    ``max_consecutive_prefill_iterations`` prompt iterations in a row.

    Args:
        sequences: Admitted sequences in sorted-id order.
        config: Normalised scheduler config.
        consecutive_prefill: Prompt-only iterations run back to back so far.

    Returns:
        The works and the new consecutive-prefill counter.
    """
    draft = PlanDraft(budget=config.max_tokens_per_iteration, work=[])
    has_prefill = any(sequence.needs_replay() for sequence in sequences)
    has_live_decode = any(sequence.is_live_decoder() for sequence in sequences)
    run_prefill = has_prefill and (
        not has_live_decode or consecutive_prefill < config.max_consecutive_prefill_iterations
    )
    for sequence in sequences:
        if draft.budget == 0:
            break
        if sequence.needs_replay():
            if run_prefill and (
                draft.prefill_sequences < config.max_prefill_sequences_per_iteration
            ):
                draft.add_prefill_chunk(sequence, config.prefill_chunk_tokens,
                                        config.sample_tail_tokens)
        elif not run_prefill and sequence.pending_decode_token() is not None:
            draft.add_decode(sequence)
    if any(work.phase is not IterationPhase.DECODE for work in draft.work):
        consecutive_prefill = consecutive_prefill + 1 if has_live_decode else 0
    elif draft.work:
        consecutive_prefill = 0
    return draft.work, consecutive_prefill


def plan_mixed(
    sequences: Sequence[ScheduledSequence], config: SchedulerConfig, decode_cursor: int
) -> tuple[list[IterationWork], int]:
    """Plan decode rows first, rotating, then fill the budget with prompt work.

    The decode start rotates so that, when live decoders outnumber the budget, every one
    of them advances in turn.

    Args:
        sequences: Admitted sequences in sorted-id order.
        config: Normalised scheduler config.
        decode_cursor: Where the previous mixed plan's decode scan stopped.

    Returns:
        The works and the new decode cursor.
    """
    draft = PlanDraft(budget=config.max_tokens_per_iteration, work=[])
    decode_cursor = _add_decode_rows(draft, sequences, decode_cursor)
    for sequence in sequences:
        if draft.budget == 0:
            break
        if draft.prefill_sequences >= config.max_prefill_sequences_per_iteration:
            break
        if sequence.needs_replay():
            draft.add_prefill_chunk(sequence, config.prefill_chunk_tokens,
                                    config.sample_tail_tokens)
    return draft.work, decode_cursor


def plan_budgeted(
    sequences: Sequence[ScheduledSequence],
    prefill_order: Sequence[ScheduledSequence],
    config: SchedulerConfig,
    prefill_budget: int,
    decode_cursor: int,
    oldest_prompt: str | None = None,
) -> tuple[list[IterationWork], int]:
    """Plan every decode row, then at most ``prefill_budget`` prompt tokens.

    Prompt tokens go to ``prefill_order`` (:func:`prompt_order`), at most
    ``prefill_chunk_tokens`` a chunk; a first prompt longer than the budget gets an equal
    chunk of its rest (:func:`even_chunk`), and a later prompt the step could hold whole
    but not in what is left waits for a step with room, except ``oldest_prompt``, which
    is never held back. Why: ``docs/scheduler.md``, *Planning an iteration* ("A long
    prompt goes in equal chunks").

    Args:
        sequences: Admitted sequences in sorted-id order (the decode rotation's order).
        prefill_order: The same sequences in the order prompt work is served.
        config: Normalised scheduler config.
        prefill_budget: Prompt tokens this iteration may carry (see ``step_budget``).
        decode_cursor: Where the previous plan's decode scan stopped.
        oldest_prompt: The oldest admission with prompt work left, if any.

    Returns:
        The works and the new decode cursor.
    """
    draft = PlanDraft(budget=config.max_tokens_per_iteration, work=[])
    decode_cursor = _add_decode_rows(draft, sequences, decode_cursor)
    prompt_budget = min(prefill_budget, draft.budget)
    for sequence in prefill_order:
        if prompt_budget <= 0:
            break
        if draft.prefill_sequences >= config.max_prefill_sequences_per_iteration:
            break
        if not sequence.needs_replay():
            continue
        remaining = sequence.replay_remaining()
        if (draft.prefill_sequences == 0 and remaining > prompt_budget
                and prompt_budget < config.prefill_chunk_tokens):
            # The step's budget ends inside the first prompt served, as every step's
            # will until it is through: the rest of it goes in equal chunks, and what
            # this one leaves of the budget is not worth a second prompt's rows (each
            # adds micro-batches to the model call).
            draft.add_prefill_chunk(sequence, min(even_chunk(remaining, prompt_budget),
                                                  config.prefill_chunk_tokens),
                                    config.sample_tail_tokens)
            break
        if (draft.prefill_sequences and sequence.id != oldest_prompt
                and prompt_budget < remaining <= prefill_budget):
            # A later prompt the step could hold whole waits for a step with room for it:
            # cut, its tail would add micro-batches to the next call as well.
            continue
        before = draft.budget
        draft.add_prefill_chunk(sequence, min(config.prefill_chunk_tokens, prompt_budget),
                                config.sample_tail_tokens)
        prompt_budget -= before - draft.budget
    return draft.work, decode_cursor


def even_chunk(remaining: int, most: int) -> int:
    """The chunk of a prompt with ``remaining`` tokens when a step may carry ``most``.

    On a CPU every chunk costs a pass over the model's weights whatever its size (about
    as long as a decode step), so a prompt should take as few chunks as its steps allow,
    with no small last one: the rest is cut into equal chunks, each at most
    :data:`CHUNK_OVERRUN` times ``most`` when going that far past the budget saves a
    whole chunk. Never below :data:`EFFICIENT_PREFILL_TOKENS` when ``most`` reaches it
    (smaller chunks run on llama.cpp's slower attention kernel).
    """
    if remaining <= most:
        return remaining
    steps = min(-(-remaining // most), -(-remaining // int(most * CHUNK_OVERRUN)))
    floor = EFFICIENT_PREFILL_TOKENS if most >= EFFICIENT_PREFILL_TOKENS else 1
    return max(-(-remaining // steps), floor)


def prompt_order(by_admission: Sequence[ScheduledSequence], prefill_budget: int, reserve: int,
                 max_sequences: int) -> list[ScheduledSequence]:
    """The order prompt work is served in: prompts that finish in this step, then oldest first.

    Promoted prompts keep admission order and never take more than ``prefill_budget -
    reserve`` tokens or every one of the ``max_sequences`` slots, so the oldest other
    prompt still advances every step: short prompts cannot starve a long one. Why:
    ``docs/scheduler.md``, *Planning an iteration* ("The step-time budget").

    Args:
        by_admission: Admitted sequences, oldest admission first.
        prefill_budget: Prompt tokens this iteration may carry.
        reserve: Tokens always left for the oldest prompt that is not promoted.
        max_sequences: Most sequences one plan may prefill.
    """
    room = prefill_budget - reserve
    promoted: list[ScheduledSequence] = []
    for sequence in by_admission:
        if len(promoted) >= max_sequences - 1:
            break
        if not sequence.needs_replay():
            continue
        remaining = sequence.replay_remaining()
        if remaining <= room:
            promoted.append(sequence)
            room -= remaining
    if not promoted:
        return list(by_admission)
    chosen = {sequence.id for sequence in promoted}
    return promoted + [sequence for sequence in by_admission if sequence.id not in chosen]


def _add_decode_rows(draft: PlanDraft, sequences: Sequence[ScheduledSequence], cursor: int) -> int:
    """Add the live decoders' rows, starting at ``cursor`` and rotating; returns the new
    cursor (where the scan stopped), so that decoders beyond the budget go next time."""
    count = len(sequences)
    start = cursor % count if count else 0
    examined = 0
    for offset in range(count):
        if draft.budget == 0:
            break
        examined = offset + 1
        sequence = sequences[(start + offset) % count]
        if sequence.is_live_decoder():
            draft.add_decode(sequence)
    return (start + examined) % count if count else cursor


def live_decode_rows(sequences: Sequence[ScheduledSequence], config: SchedulerConfig) -> int:
    """Live decoders, capped at the iteration budget (the calibration key)."""
    rows = sum(1 for sequence in sequences if sequence.is_live_decoder())
    return min(rows, config.max_tokens_per_iteration)


def check_plan_invariants(
    plan: IterationPlan,
    config: SchedulerConfig,
    active: Mapping[str, ScheduledSequence],
    waiting: Sequence[ScheduledSequence],
) -> None:
    """Raise RuntimeError, naming the values, if a fresh plan breaks a scheduler invariant.

    Checked after every ``plan_iteration``: the budget holds, no sequence appears twice,
    prompt chunks respect the chunk and per-plan limits, the active set respects its cap
    and no sequence is both waiting and active.
    """
    ids = [work.sequence_id for work in plan.work]
    prompt_rows = [w for w in plan.work if w.phase is not IterationPhase.DECODE]
    problems = []
    if plan.token_count != sum(w.token_count for w in plan.work):
        problems.append(f"token_count {plan.token_count} is not the sum of the works")
    if plan.token_count > config.max_tokens_per_iteration:
        problems.append(f"{plan.token_count} tokens > budget {config.max_tokens_per_iteration}")
    if len(set(ids)) != len(ids):
        problems.append(f"a sequence appears twice: {ids}")
    if any(w.token_count == 0 or w.token_count > config.prefill_chunk_tokens
           for w in prompt_rows):
        problems.append("a prompt chunk is empty or larger than prefill_chunk_tokens")
    if len(prompt_rows) > config.max_prefill_sequences_per_iteration:
        problems.append(f"{len(prompt_rows)} prefilling sequences in one plan")
    if len(active) > config.max_active_sequences:
        problems.append(f"{len(active)} active > {config.max_active_sequences}")
    if any(sequence.id in active for sequence in waiting):
        problems.append("a sequence is both waiting and active")
    if problems:
        raise RuntimeError("scheduler plan invariant broken: " + "; ".join(problems))

