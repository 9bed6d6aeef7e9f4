"""``n > 1`` choices on the worker thread: one prompt prefill, copied into every choice.

The choices of one request reach the worker as one *leader* (the first choice) and
*followers* (``GenerationRequest.fork_of``). A follower waits outside the policy until
the leader has computed the prompt (its first sample), then enters the policy with the
prompt, all but its last token, marked as restored: when it gets a lane,
:meth:`ChoiceForks.restore` copies those tokens from the leader (or from a sibling that
already holds them) with ``fork_session``, and the follower computes only the last
prompt token, in the same batch as everyone else, to sample its own first token. If no
session holds the prompt any more (the leader finished while the follower waited for a
lane), the follower computes it itself. A runtime that cannot fork serves followers as
ordinary requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from skippyd.engine.policy import CacheAffinity, PrefixRestore
from skippyd.engine.runtime.protocol import IterationRequest, Runtime, can_fork
from skippyd.engine.worker.thread_cache import Admission

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Group:
    """One leader's followers: those still waiting, and those already released."""

    prompt_tokens: tuple[int, ...]
    waiting: list[Any] = field(default_factory=list)
    """``RequestState`` of followers waiting for the leader's prompt."""
    released: list[str] = field(default_factory=list)


class ChoiceForks:
    """Followers of every leader; worker thread only.

    Args:
        runtime: The worker's runtime (forks when it has ``fork_session``).
        chunk_tokens: Prefill chunk for recomputing a prompt no session holds.
    """

    def __init__(self, runtime: Runtime, chunk_tokens: int) -> None:
        self._runtime = runtime
        self._fork: Callable[..., None] | None = (
            runtime.fork_session if can_fork(runtime) else None)  # type: ignore[attr-defined]
        self._chunk_tokens = max(1, chunk_tokens)
        self._groups: dict[str, _Group] = {}
        self._leader_of: dict[str, str] = {}
        """Follower id -> leader id, from hold until the follower leaves."""

    @property
    def num_waiting(self) -> int:
        return sum(len(group.waiting) for group in self._groups.values())

    def hold(self, state: Any, leader_prompt: tuple[int, ...] | None) -> bool:
        """Keep a follower until its leader's prompt is computed.

        Args:
            state: The follower's ``RequestState``.
            leader_prompt: The leader's prompt, or None when the leader is not held.

        Returns:
            False when the follower cannot share (no leader, another prompt, a prompt of
            one token, a runtime without forks): the caller serves it on its own.
        """
        request = state.request
        prompt = tuple(request.prompt_tokens)
        if (self._fork is None or leader_prompt != prompt or len(prompt) < 2
                or request.generated_tokens or request.retain_runtime):
            return False
        group = self._groups.setdefault(request.fork_of, _Group(prompt))
        group.waiting.append(state)
        self._leader_of[request.request_id] = request.fork_of
        return True

    def release(self, leader_id: str) -> Iterator[tuple[Any, Admission]]:
        """The leader's prompt is computed: its waiting followers and their admissions."""
        group = self._groups.get(leader_id)
        if group is None or not group.waiting:
            return
        waiting, group.waiting = group.waiting, []
        restore = PrefixRestore(f"fork:{leader_id}", len(group.prompt_tokens) - 1)
        for state in waiting:
            group.released.append(state.request.request_id)
            yield state, Admission(restore, CacheAffinity())

    def abandon(self, leader_id: str) -> list[Any]:
        """The leader left: followers still waiting are served on their own."""
        group = self._groups.pop(leader_id, None)
        if group is None:
            return []
        for state in group.waiting:
            self._leader_of.pop(state.request.request_id, None)
        # Released followers keep their leader id: a sibling may still hold the prompt.
        if group.released:
            self._groups[leader_id] = _Group(group.prompt_tokens, released=group.released)
        return group.waiting

    def forget(self, req_id: str) -> bool:
        """A follower left (cancel, failure, completion); True if it was still waiting."""
        leader_id = self._leader_of.pop(req_id, None)
        group = self._groups.get(leader_id) if leader_id is not None else None
        if group is None:
            return False
        was_waiting = any(s.request.request_id == req_id for s in group.waiting)
        group.waiting = [s for s in group.waiting if s.request.request_id != req_id]
        if req_id in group.released:
            group.released.remove(req_id)
        if not group.waiting and not group.released:
            self._groups.pop(leader_id, None)
        return was_waiting

    def restore(self, req_id: str) -> None:
        """Fill a follower's fresh lane with the prompt but its last token.

        Raises:
            RuntimeFailure: Neither a copy nor a recomputation could be made.
        """
        leader_id = self._leader_of.get(req_id)
        group = self._groups.get(leader_id) if leader_id is not None else None
        if group is None or req_id not in group.released or self._fork is None:
            return
        count = len(group.prompt_tokens) - 1
        for source in (leader_id, *group.released):
            held = self._runtime.session_token_count(source)
            if source != req_id and held is not None and held >= count:
                self._fork(source, req_id, count)
                return
        logger.info("no session holds the prompt of %s any more: recomputing %d tokens",
                    req_id, count)
        self._recompute(req_id, group.prompt_tokens[:count])

    def _recompute(self, session_id: str, tokens: tuple[int, ...]) -> None:
        self._runtime.trim_session(session_id, 0)
        for start in range(0, len(tokens), self._chunk_tokens):
            chunk = tokens[start:start + self._chunk_tokens]
            self._runtime.iteration_batch_sampled([IterationRequest(
                session_id, chunk, positions=range(start, start + len(chunk)))])
