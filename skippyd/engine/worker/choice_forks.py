"""``n > 1`` choices: one prompt prefill, copied into every choice (worker thread only).

The choices of one request reach the worker as one *first choice* and *later choices*
(``GenerationRequest.fork_of``). A later choice waits outside the policy
(AWAITING_PROMPT) until the first choice has computed the prompt (its first sample),
then enters the policy with the prompt, all but its last token, marked as restored:
when it gets a lane, :meth:`ChoiceForks.restore` copies those tokens from the first
choice (or from a sibling that already holds them) with ``fork_session``, and the later
choice computes only the last prompt token, in the same batch as everyone else, to
sample its own first token. If no session holds the prompt any more (the first choice
finished while this one waited for a lane), it computes the prompt itself. A runtime
that cannot fork serves later choices as ordinary requests.

The links live on the records (``first_choice``, ``later_choices``); this class only
applies the rules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from skippyd.engine.policy import CacheAffinity, PrefixRestore
from skippyd.engine.runtime.contract import Runtime
from skippyd.engine.worker.prefix_admission import Admission, recompute
from skippyd.engine.worker.record import Generation, GenerationStatus

logger = logging.getLogger(__name__)


class ChoiceForks:
    """The ``n > 1`` rules over the records; see the module docstring.

    Args:
        runtime: The worker's runtime (forks when it can).
        chunk_tokens: Prefill chunk for recomputing a prompt no session holds.
    """

    def __init__(self, runtime: Runtime, chunk_tokens: int) -> None:
        self._runtime = runtime
        self._fork: Callable[..., None] | None = (
            runtime.fork_session if runtime.can_fork else None)
        self._chunk_tokens = max(1, chunk_tokens)

    def hold(self, gen: Generation, first: Generation | None) -> bool:
        """Keep a later choice until ``first`` (its first choice, if held) has the prompt.

        Returns:
            False when it cannot share (no first choice, another prompt, a prompt of one
            token, a runtime without forks): the caller serves it on its own.
        """
        if (self._fork is None or first is None or first.finished
                or first.prompt != gen.prompt or len(gen.prompt) < 2):
            return False
        gen.first_choice = first
        first.later_choices.append(gen)
        gen.move_to(GenerationStatus.AWAITING_PROMPT)
        return True

    @staticmethod
    def prompt_computed(first: Generation) -> bool:
        """Whether the first choice has computed the prompt (it sampled once)."""
        return first.num_generated > 0 or first.saw_eog

    @staticmethod
    def release(first: Generation) -> list[tuple[Generation, Admission]]:
        """The first choice's prompt is computed: its waiting later choices, each with the
        admission that copies the prompt."""
        waiting = [g for g in first.later_choices if g.status is GenerationStatus.AWAITING_PROMPT]
        if not waiting:
            return []
        count = len(first.prompt) - 1
        restore = PrefixRestore(f"fork:{first.id}", count)
        for gen in waiting:
            gen.fork_tokens = count
        return [(gen, Admission(restore, CacheAffinity())) for gen in waiting]

    @staticmethod
    def leave(gen: Generation) -> list[Generation]:
        """``gen`` is ending: unlink it from its siblings.

        Returns:
            Its later choices still waiting for the prompt, now on their own, to be
            routed as ordinary requests. Released ones keep their link: a sibling may
            still hold the prompt they copy.
        """
        if gen.first_choice is not None:
            siblings = gen.first_choice.later_choices
            if gen in siblings:
                siblings.remove(gen)
        orphans = [g for g in gen.later_choices if g.status is GenerationStatus.AWAITING_PROMPT]
        for orphan in orphans:
            orphan.first_choice = None
            gen.later_choices.remove(orphan)
        return orphans

    def restore(self, gen: Generation) -> None:
        """Fill a released later choice's fresh lane with the prompt but its last token.

        Raises:
            RuntimeFailure: Neither a copy nor a recomputation could be made.
        """
        first, count = gen.first_choice, gen.fork_tokens
        if first is None or count == 0 or self._fork is None:
            return
        for source in (first, *first.later_choices):
            held = self._runtime.session_token_count(source.id)
            if source is not gen and held is not None and held >= count:
                self._fork(source.id, gen.id, count)
                return
        logger.info("no session holds the prompt of %s any more: recomputing %d tokens",
                    gen.id, count)
        recompute(self._runtime, gen.id, gen.prompt[:count], self._chunk_tokens)
