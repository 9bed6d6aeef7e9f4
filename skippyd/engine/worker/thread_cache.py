"""The prefix cache in the planned-generation path (worker thread only).

:class:`PrefixCacheFlow` decides, for every fresh generation, how it meets the cache:

* **hit**: the prompt starts with a cached prefix. The request leases that entry; its
  policy ``Sequence`` gets ``with_prefix_restore`` (the policy's replay rule
  keeps the last prompt token computed) and a ``CacheAffinity`` from the same lookup, so
  the policy's cache-aware ordering sees its value. When the request gets
  a lane it is the entry's own lane if that is idle (nothing to copy), else the entry is
  copied or, from the host-RAM tier, loaded into it; only the rest of the prompt is
  prefilled.
* **in flight**: a request already in the scheduler (the *leader*) shares a longer
  prefix than the cache holds. If the leader's KV already holds it, it is recorded from
  the leader's lane at once; otherwise the new request is *parked* until the leader's
  prefill passes the shared point, which is then recorded (a shared-prefix record, at
  most ``shared_prefix_record_limit`` per leader, each extending what is cached by at
  least ``shared_prefix_stride_tokens``) and the parked request restores it. So a burst
  sharing a long system prompt prefills it once, not once per request.
* finished requests record their whole KV history (prompt plus generated tokens) as
  their lane is freed (the lane keeps its KV): the next turn of a chat matches it.

Parked requests are outside the policy until released; the worker counts them as waiting.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from skippyd.engine.policy import CacheAffinity, PrefixRestore, Scheduler
from skippyd.engine.prefix_cache import LivePrefixCache, common_prefix_length
from skippyd.engine.runtime.protocol import IterationRequest, Runtime, RuntimeFailure
from skippyd.engine.worker.commands import GenerationRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admission:
    """How a request enters the policy."""

    restore: PrefixRestore | None
    affinity: CacheAffinity


@dataclass(slots=True)
class _Parked:
    request: GenerationRequest
    leader_id: str
    point: int
    """Tokens the leader's KV must hold before the shared prefix is recorded."""


class PrefixCacheFlow:
    """Lookup, parking, restore and recording for planned generations.

    Args:
        cache: The live cache (over the worker's runtime).
        runtime: The worker's runtime, for recomputing a prefix that is gone.
        scheduler: The policy scheduler (waiting-queue size only).
        prompts: Prompt tokens of every request the worker holds, by id.
    """

    def __init__(self, cache: LivePrefixCache, runtime: Runtime, scheduler: Scheduler,
                 prompts: Callable[[], Mapping[str, SequenceOf[int]]]) -> None:
        self.cache = cache
        self._runtime = runtime
        self._scheduler = scheduler
        self._prompts = prompts
        self.parked: dict[str, _Parked] = {}
        self._records: Counter[str] = Counter()

    # -- routing ---------------------------------------------------------------------------

    def route(self, request: GenerationRequest) -> Admission | None:
        """Admission of a fresh request, or None when it was parked behind a leader."""
        settings = self.cache.settings
        if not settings.lookup:
            return Admission(None, CacheAffinity())
        prompt = tuple(request.prompt_tokens)
        cached = self.cache.peek(prompt).num_tokens
        leader_id, point = self._best_leader(request.request_id, prompt, cached)
        if leader_id is not None:
            if self._holds(leader_id, prompt, point):
                self._record_shared(leader_id, point)
            elif self._may_park():
                self.parked[request.request_id] = _Parked(request, leader_id, point)
                logger.debug("parked %s behind %s until %d tokens", request.request_id,
                             leader_id, point)
                return None
        affinity = self.cache.affinity(prompt)
        lease = self.cache.lease(request.request_id, prompt)
        if lease is None:
            return Admission(None, affinity)
        return Admission(PrefixRestore(lease.entry_id, len(lease.tokens)), affinity)

    def _best_leader(self, req_id: str, prompt: tuple[int, ...],
                     cached: int) -> tuple[str | None, int]:
        """The in-flight request sharing the most beyond ``cached`` tokens, and how much."""
        settings = self.cache.settings
        best_id, best_point = None, 0
        for leader_id, leader_prompt in self._prompts().items():
            if (leader_id == req_id or leader_id in self.parked
                    or self._records[leader_id] >= settings.shared_prefix_record_limit):
                continue
            shared = max(common_prefix_length(prompt, tuple(leader_prompt)),
                         common_prefix_length(prompt, self.cache.runtime.session_history(leader_id)))
            if shared < settings.min_tokens or shared - cached < settings.shared_prefix_stride_tokens:
                continue
            if shared > best_point:
                best_id, best_point = leader_id, shared
        return best_id, best_point

    def _holds(self, leader_id: str, prompt: tuple[int, ...], point: int) -> bool:
        history = self.cache.runtime.session_history(leader_id)
        return len(history) >= point and common_prefix_length(history, prompt) >= point

    def _may_park(self) -> bool:
        """Parked requests count against the waiting-queue capacity."""
        waiting = self._scheduler.metrics().waiting_sequences + len(self.parked)
        return waiting < self._scheduler.config.max_waiting_sequences

    def _record_shared(self, leader_id: str, point: int) -> None:
        if self.cache.record(leader_id, point) is not None:
            self._records[leader_id] += 1

    # -- releasing parked requests ---------------------------------------------------------

    def release_ready(self) -> list[GenerationRequest]:
        """Record for every leader whose KV passed its parked requests' points.

        Returns:
            The released requests, to be routed again (now hitting the new record).
        """
        ready: dict[str, list[_Parked]] = {}
        for parked in self.parked.values():
            history = self.cache.runtime.session_history(parked.leader_id)
            prompt = tuple(parked.request.prompt_tokens)
            if len(history) >= parked.point and common_prefix_length(history, prompt) >= parked.point:
                ready.setdefault(parked.leader_id, []).append(parked)
        released = []
        for leader_id, group in ready.items():
            self._record_shared(leader_id, max(parked.point for parked in group))
            for parked in group:
                del self.parked[parked.request.request_id]
                released.append(parked.request)
        return released

    def release_followers(self, leader_id: str) -> list[GenerationRequest]:
        """The leader left: release everything parked behind it, to be routed again."""
        self._records.pop(leader_id, None)
        group = [p for p in self.parked.values() if p.leader_id == leader_id]
        for parked in group:
            del self.parked[parked.request.request_id]
        return [parked.request for parked in group]

    def forget(self, req_id: str) -> bool:
        """Drop a request's parking spot and lease (cancel, failure); True if it was parked."""
        self.cache.release(req_id)
        return self.parked.pop(req_id, None) is not None

    # -- lanes -----------------------------------------------------------------------------

    def bind(self, req_id: str, chunk_tokens: int) -> None:
        """Give a fresh request its lane and its leased prefix, recomputing it if it is gone.

        The lane is the cache's choice (:meth:`LivePrefixCache.place`): the leased
        entry's own lane restores in place; any other lane gets the prefix copied or
        loaded into it.

        Raises:
            RuntimeFailure: The session could not be bound, or the prefix neither
                restored nor recomputed.
        """
        placement = self.cache.place(req_id)
        self._runtime.ensure_session_active(req_id, lane=placement.lane,
                                            keep_tokens=placement.keep_tokens)
        lease = self.cache.lease_of(req_id)
        if lease is None or self.cache.restore(req_id, req_id):
            return
        logger.info("prefix entry of %s is gone: recomputing %d tokens", req_id,
                    len(lease.tokens))
        self._recompute(req_id, lease.tokens, chunk_tokens)

    def _recompute(self, session_id: str, tokens: tuple[int, ...], chunk_tokens: int) -> None:
        self._runtime.trim_session(session_id, 0)
        start = 0
        while start < len(tokens):
            chunk = tokens[start:start + chunk_tokens]
            request = IterationRequest(session_id, chunk,
                                       positions=range(start, start + len(chunk)))
            self._runtime.iteration_batch_sampled([request])
            start += len(chunk)

    def record_finished(self, req_id: str) -> None:
        """Record a finishing request's whole KV history (before its lane is dropped).

        Its own lease goes first: the entry it restored from may give its slot up.
        """
        self.cache.release(req_id)
        if not self.cache.settings.record:
            return
        try:
            self.cache.record(req_id, len(self.cache.runtime.session_history(req_id)))
        except RuntimeFailure as exc:
            logger.warning("recording the prefix of %s failed: %s", req_id, exc)
