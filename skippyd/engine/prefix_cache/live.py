"""The prefix cache on a live runtime: record, lease, restore, demote and evict entries.

:class:`LivePrefixCache` joins the :class:`EntryTable` bookkeeping to the runtime's slot
operations. Every method but :meth:`stats` and :meth:`cached_prompt_tokens` runs on the
worker thread (the only thread allowed to call the runtime); those two read values the
worker replaces atomically, so the HTTP and control threads may call them at any time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from skippyd.engine.policy import CacheAffinity, StageCacheAffinity
from skippyd.engine.prefix_cache.entries import (
    CacheEntry,
    CacheMatch,
    EntryTable,
    PrefixCacheStats,
    Tier,
    host_cost,
    state_nbytes,
)
from skippyd.engine.prefix_cache.eviction import (
    budget_victims,
    host_victims,
    pressure_victims,
    slot_victim,
)
from skippyd.engine.prefix_cache.settings import (
    HOST_RESTORE_COST_DIVISOR,
    MAX_REMEMBERED_REQUESTS,
    PREFILL_COST_PER_TOKEN,
    PrefixCacheSettings,
)

logger = logging.getLogger(__name__)

#: Telemetry event published for every cache operation.
PREFIX_CACHE_EVENT = "stage.prefix_cache"
_ATTR = "skippy.prefix_cache."

Publish = Callable[[str, Mapping[str, Any]], None]


class SlotRuntime(Protocol):
    """What the cache needs from a runtime (``LlamaRuntime`` with its slot methods)."""

    @property
    def cache_slot_ids(self) -> range: ...

    @property
    def kv_pool_tokens(self) -> int: ...

    def session_history(self, session_id: str) -> tuple[int, ...]: ...

    def session_histories(self) -> list[tuple[int, ...]]: ...

    def copy_session_to_slot(self, session_id: str, slot: int, num_tokens: int) -> None: ...

    def copy_slot_to_session(self, slot: int, session_id: str, tokens: Sequence[int]) -> None: ...

    def clear_slot(self, slot: int) -> None: ...

    def save_slot_state(self, slot: int) -> Sized:
        """The slot's saved state; ``len()`` is its host RAM in bytes."""

    def slot_state_bytes(self, slot: int) -> int: ...

    def load_session_state(self, session_id: str, state: Any,
                           tokens: Sequence[int]) -> bool: ...

    def trim_session(self, session_id: str, token_count: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Lease:
    """A request's claim on an entry, from lookup until the request leaves."""

    req_id: str
    entry_id: str
    tokens: tuple[int, ...]
    """The prompt prefix to restore."""


class LivePrefixCache:
    """The prefix cache of one stage; see the module docstring.

    Args:
        runtime: The runtime whose reserved sequence ids hold resident entries.
        settings: Budgets and modes.
        namespace: Model and layer range the entries belong to.
        stage_index: This stage's index, for cache affinities.
        publish: Telemetry sink (the worker's hub).
    """

    def __init__(self, runtime: SlotRuntime, settings: PrefixCacheSettings, *,
                 namespace: str, stage_index: int = 0, publish: Publish | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.namespace = namespace
        self.stage_index = stage_index
        self.table = EntryTable(settings, runtime.cache_slot_ids)
        self._publish_fn = publish
        self._leases: dict[str, Lease] = {}
        self._cached_tokens: OrderedDict[str, int] = OrderedDict()
        self._cached_lock = threading.Lock()
        self._stats = PrefixCacheStats()

    # -- views (any thread) ---------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        """The latest counters (replaced by the worker after every change)."""
        return self._stats

    def cached_prompt_tokens(self, req_id: str) -> int:
        """Prompt tokens of ``req_id`` restored from the cache (0 if none or forgotten)."""
        with self._cached_lock:
            return self._cached_tokens.get(req_id, 0)

    # -- lookups ------------------------------------------------------------------------

    def peek(self, prompt: Sequence[int]) -> CacheMatch:
        """Best match for ``prompt``; touches no recency and counts nothing."""
        return self.table.match(tuple(prompt))

    def affinity(self, prompt: Sequence[int]) -> CacheAffinity:
        """Cache affinity of ``prompt`` from a peek."""
        match = self.peek(prompt)
        if match.entry is None:
            return CacheAffinity()
        restore_cost = 0
        if match.entry.tier is Tier.HOST:
            restore_cost = match.num_tokens * PREFILL_COST_PER_TOKEN // HOST_RESTORE_COST_DIVISOR
        return CacheAffinity.from_stage(StageCacheAffinity(
            self.stage_index, match.num_tokens, PREFILL_COST_PER_TOKEN, restore_cost,
            self.table.epoch))

    def lease(self, req_id: str, prompt: Sequence[int]) -> Lease | None:
        """Look ``prompt`` up for a request about to be queued, and pin the entry found.

        Counts a hit or a miss and remembers the restored token count, which follows the
        policy's replay rule: the last prompt token is always computed.
        """
        self.release(req_id)
        prompt = tuple(prompt)
        match = self.table.match(prompt)  # no entry: 0 tokens
        restored = min(match.num_tokens, max(0, len(prompt) - 1))
        self._remember(req_id, restored)
        self.table.count_lookup(restored, len(prompt))
        if match.entry is None or restored == 0:
            self._refresh("lookup", tokens=0)
            return None
        self.table.touch(match.entry)
        match.entry.hits += 1
        match.entry.pins.add(req_id)
        lease = Lease(req_id, match.entry.id, prompt[:match.num_tokens])
        self._leases[req_id] = lease
        self._refresh("lookup", tokens=restored, tier=match.entry.tier.value)
        return lease

    def lease_of(self, req_id: str) -> Lease | None:
        return self._leases.get(req_id)

    def release(self, req_id: str) -> None:
        """Unpin the request's entry; idempotent."""
        lease = self._leases.pop(req_id, None)
        if lease is None:
            return
        entry = self.table.entries.get(lease.entry_id)
        if entry is not None:
            entry.pins.discard(req_id)

    def _remember(self, req_id: str, restored: int) -> None:
        with self._cached_lock:
            self._cached_tokens[req_id] = restored
            self._cached_tokens.move_to_end(req_id)
            while len(self._cached_tokens) > MAX_REMEMBERED_REQUESTS:
                self._cached_tokens.popitem(last=False)

    # -- restore --------------------------------------------------------------------------

    def restore(self, req_id: str, session_id: str) -> bool:
        """Put the request's leased prefix into ``session_id``'s KV.

        Returns:
            True when the session now holds exactly the lease's tokens; False when the
            entry is gone or did not fit (the caller recomputes the prefix).
        """
        lease = self._leases.get(req_id)
        if lease is None:
            return False
        entry = self.table.entries.get(lease.entry_id)
        if entry is None or entry.tier is not Tier.RESIDENT:
            fallback = self.table.covers(lease.tokens)
            entry = fallback if fallback is not None else entry
        if entry is None:
            return False
        if entry.tier is Tier.RESIDENT:
            self.runtime.copy_slot_to_session(_slot(entry), session_id, lease.tokens)
        elif not self._restore_from_host(entry, session_id, lease.tokens):
            return False
        self.table.touch(entry)
        self._refresh("restore", tokens=len(lease.tokens), tier=entry.tier.value)
        return True

    def _restore_from_host(self, entry: CacheEntry, session_id: str,
                           tokens: tuple[int, ...]) -> bool:
        """Load a host entry into the session, promote it back to a slot, trim to ``tokens``."""
        state = entry.state
        if state is None:
            raise RuntimeError(f"host entry without a saved state: {entry.anon_repr()}")
        loaded = self.runtime.load_session_state(session_id, state, entry.tokens)
        if not loaded and self.relieve_kv_pressure(entry.num_tokens):
            loaded = self.runtime.load_session_state(session_id, state, entry.tokens)
        if not loaded:
            logger.info("host entry %s did not fit the KV pool", entry.id)
            return False
        if self._make_slot_room(entry.num_tokens):
            slot = self.table.move_to_resident(entry)
            self.runtime.copy_session_to_slot(session_id, slot, entry.num_tokens)
        if len(tokens) < entry.num_tokens:
            self.runtime.trim_session(session_id, len(tokens))
        return True

    # -- recording ------------------------------------------------------------------------

    def record(self, session_id: str, num_tokens: int) -> CacheEntry | None:
        """Record the session's first ``num_tokens`` cells as an entry (cells shared).

        Returns:
            The entry holding that prefix (maybe an existing one), or None when it is too
            short or no slot or budget could be found.
        """
        if not self.settings.record or num_tokens < self.settings.min_tokens:
            return None
        tokens = self.runtime.session_history(session_id)[:num_tokens]
        if len(tokens) < num_tokens:
            return None
        existing = self.table.covers(tokens)
        if existing is not None:
            self.table.touch(existing)
            return existing
        if not self._make_slot_room(num_tokens):
            return None
        entry = self.table.add_resident(tokens)
        self.runtime.copy_session_to_slot(session_id, _slot(entry), num_tokens)
        if self.table.kv_bytes_per_token == 0:
            self.table.kv_bytes_per_token = self.runtime.slot_state_bytes(_slot(entry)) // num_tokens
        for shorter in self.table.superseded(entry):
            self._drop(shorter, evicted=False)
        self._refresh("record", tokens=num_tokens, tier=Tier.RESIDENT.value)
        return entry

    def _make_slot_room(self, num_tokens: int) -> bool:
        """Evict (by the capacity plan) until a ``num_tokens`` entry gets a slot and budget."""
        victims = budget_victims(self.table, num_tokens)
        if victims is None:
            return False
        for victim in victims:
            self._evict(victim)
        while not self.table.has_free_slot():
            victim = slot_victim(self.table, self.runtime.session_histories())
            if victim is None:
                return False
            self._evict(victim)
        return True

    # -- eviction -------------------------------------------------------------------------

    def relieve_kv_pressure(self, needed_tokens: int) -> bool:
        """Evict resident entries so ``needed_tokens`` more cells may fit.

        Returns:
            True if an entry holding cells of its own was evicted (worth a retry).
        """
        victims = pressure_victims(self.table, needed_tokens, self.runtime.kv_pool_tokens,
                                   self.runtime.session_histories())
        for victim in victims:
            self._evict(victim)
        if victims:
            logger.info("KV pressure: evicted %d prefix-cache entr%s", len(victims),
                        "y" if len(victims) == 1 else "ies")
        return bool(victims)

    def _evict(self, entry: CacheEntry) -> None:
        """Move a resident entry out of the pool: to host RAM if it fits, else drop it."""
        slot = _slot(entry)
        if self.settings.host_tier:
            state = self.runtime.save_slot_state(slot)
            victims = host_victims(self.table,
                                   host_cost(state_nbytes(state), entry.num_tokens))
            if victims is not None:
                for victim in victims:
                    self.table.remove(victim)
                self.runtime.clear_slot(slot)
                self.table.move_to_host(entry, state)
                self._refresh("demote", tokens=entry.num_tokens, tier=Tier.HOST.value)
                return
        self._drop(entry, evicted=True)

    def _drop(self, entry: CacheEntry, *, evicted: bool) -> None:
        if entry.slot is not None:
            self.runtime.clear_slot(entry.slot)
        self.table.remove(entry, evicted=evicted)
        self._refresh("drop", tokens=entry.num_tokens)

    def clear(self) -> None:
        """Drop every entry (shutdown, tests)."""
        for entry in list(self.table.entries.values()):
            self._drop(entry, evicted=False)

    # -- telemetry ------------------------------------------------------------------------

    def _refresh(self, operation: str, *, tokens: int, tier: str = "") -> None:
        """Publish the new counters after a change (one reference swap for readers)."""
        self._stats = stats = self.table.stats()
        if self._publish_fn is None:
            return
        attributes: dict[str, Any] = {_ATTR + "operation": operation, _ATTR + "tokens": tokens,
                                      _ATTR + "tier": tier, _ATTR + "epoch": self.table.epoch}
        attributes.update({_ATTR + key: value for key, value in stats.telemetry().items()})
        self._publish_fn(PREFIX_CACHE_EVENT, attributes)


def _slot(entry: CacheEntry) -> int:
    """The slot of a resident entry."""
    if entry.slot is None:
        raise RuntimeError(f"resident entry without a slot: {entry.anon_repr()}")
    return entry.slot
