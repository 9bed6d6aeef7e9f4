"""How a fresh generation meets the prefix cache (worker thread only).

On a **hit** the request leases a cached prefix and starts in that entry's lane, or gets
the prefix copied or loaded into its own; **in flight**, a request sharing a longer prefix
with one still prefilling is *parked* until that prefix has been computed once and
recorded, so a burst with one long system prompt prefills it once; a **finished** request
records its whole KV history as its lane is freed. :class:`PrefixAdmission` keeps no
per-request state: a request's lease and parking live on its
:class:`~skippyd.engine.worker.record.Generation`. ``docs/scheduler.md``, *A fresh
request and the prefix cache*, has the rules.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from skippyd.engine.policy import CacheAffinity, PrefixRestore
from skippyd.engine.prefix_cache import LivePrefixCache, common_prefix_length
from skippyd.engine.runtime.contract import IterationRequest, Runtime, RuntimeFailure
from skippyd.engine.worker.record import Generation, GenerationStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admission:
    """How a request enters the policy."""

    restore: PrefixRestore | None
    affinity: CacheAffinity


NO_CACHE = Admission(None, CacheAffinity())


class PrefixAdmission:
    """Lookup, parking, restore and recording; see the module docstring.

    Args:
        cache: The live cache (over the worker's runtime).
        runtime: The worker's runtime, for recomputing a prefix that is gone.
    """

    def __init__(self, cache: LivePrefixCache, runtime: Runtime) -> None:
        self.cache = cache
        self._runtime = runtime

    # -- routing ---------------------------------------------------------------------------

    def route(self, gen: Generation, held: Iterable[Generation], may_park: bool) -> Admission | None:
        """Admission of a fresh request, or None when it was parked behind a leader.

        Args:
            gen: The request (NEW, or PARKED or AWAITING_PROMPT being routed again).
            held: Every other request the worker holds (leader candidates).
            may_park: Whether the waiting queue has room for one more parked request.
        """
        self.release(gen)
        settings = self.cache.settings
        if not settings.lookup:
            return NO_CACHE
        prompt = gen.prompt
        cached = self.cache.peek(prompt).num_tokens
        leader, point = self._best_leader(gen, prompt, cached, held)
        if leader is not None:
            if self._holds(leader, prompt, point):
                self._record_shared(leader, point)
            elif may_park:
                gen.parked_behind, gen.park_point = leader, point
                gen.move_to(GenerationStatus.PARKED)
                logger.debug("parked %s behind %s until %d tokens", gen.id, leader.id, point)
                return None
        affinity = self.cache.affinity(prompt)
        gen.lease = self.cache.lease(gen.id, prompt)
        gen.cached_tokens = 0 if gen.lease is None else len(gen.lease.tokens)
        if gen.lease is None:
            return Admission(None, affinity)
        return Admission(PrefixRestore(gen.lease.entry_id, len(gen.lease.tokens)), affinity)

    def _best_leader(self, gen: Generation, prompt: tuple[int, ...], cached: int,
                     held: Iterable[Generation]) -> tuple[Generation | None, int]:
        """The held request sharing the most beyond ``cached`` tokens, and how much."""
        settings = self.cache.settings
        best, best_point = None, 0
        for leader in held:
            if (leader is gen or leader.status is GenerationStatus.PARKED
                    or leader.shared_records >= settings.shared_prefix_record_limit):
                continue
            shared = max(common_prefix_length(prompt, leader.prompt),
                         common_prefix_length(prompt, self.cache.runtime.session_history(
                             leader.id)))
            if shared < settings.min_tokens or shared - cached < settings.shared_prefix_stride_tokens:
                continue
            if shared > best_point:
                best, best_point = leader, shared
        return best, best_point

    def _holds(self, leader: Generation, prompt: tuple[int, ...], point: int) -> bool:
        history = self.cache.runtime.session_history(leader.id)
        return len(history) >= point and common_prefix_length(history, prompt) >= point

    def _record_shared(self, leader: Generation, point: int) -> None:
        if self.cache.record(leader.id, point) is not None:
            leader.shared_records += 1

    def ready_to_release(self, parked: Iterable[Generation]) -> list[Generation]:
        """Record for every leader whose KV passed its parked requests' points.

        Returns:
            The parked requests whose prefix is now recorded, to be routed again (they
            hit the new record).
        """
        ready: dict[int, list[Generation]] = {}
        leaders: dict[int, Generation] = {}
        for gen in parked:
            leader = gen.parked_behind
            assert leader is not None
            if self._holds(leader, gen.prompt, gen.park_point):
                ready.setdefault(id(leader), []).append(gen)
                leaders[id(leader)] = leader
        released = []
        for key, group in ready.items():
            self._record_shared(leaders[key], max(gen.park_point for gen in group))
            released.extend(group)
        return released

    def release(self, gen: Generation) -> None:
        """Drop the request's lease; idempotent."""
        if gen.lease is not None:
            self.cache.release(gen.lease)
            gen.lease = None

    # -- lanes -----------------------------------------------------------------------------

    def bind(self, gen: Generation, chunk_tokens: int) -> None:
        """Give a fresh request its lane and its leased prefix, recomputing it if it is gone.

        The lane is the cache's choice (:meth:`LivePrefixCache.place`): the leased
        entry's own lane restores in place; any other lane gets the prefix copied or
        loaded into it.

        Raises:
            RuntimeFailure: The session could not be bound, or the prefix neither
                restored nor recomputed.
        """
        placement = self.cache.place(gen.lease)
        self._runtime.ensure_session_active(gen.id, lane=placement.lane,
                                            keep_tokens=placement.keep_tokens)
        gen.has_session = True
        if gen.lease is None or self.cache.restore(gen.lease, gen.id):
            return
        logger.info("prefix entry of %s is gone: recomputing %d tokens", gen.id,
                    len(gen.lease.tokens))
        recompute(self._runtime, gen.id, gen.lease.tokens, chunk_tokens)

    def record_finished(self, gen: Generation) -> None:
        """Record a finishing request's whole KV history (before its lane is dropped).

        Its own lease goes first: the entry it restored from may give its slot up.
        """
        self.release(gen)
        if not self.cache.settings.record or not gen.has_session:
            return
        try:
            self.cache.record(gen.id, len(self.cache.runtime.session_history(gen.id)))
        except RuntimeFailure as exc:
            logger.warning("recording the prefix of %s failed: %s", gen.id, exc)


def recompute(runtime: Runtime, session_id: str, tokens: tuple[int, ...],
              chunk_tokens: int) -> None:
    """Compute ``tokens`` into the session from position 0, in chunks, sampling nothing."""
    runtime.trim_session(session_id, 0)
    chunk_tokens = max(1, chunk_tokens)
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        runtime.run_iteration([IterationRequest(
            session_id, chunk, positions=range(start, start + len(chunk)))])
