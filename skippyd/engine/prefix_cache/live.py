"""The prefix cache on a live runtime: record, lease, place, restore and demote entries.

:class:`LivePrefixCache` joins the :class:`EntryTable` bookkeeping to the runtime's lane
operations. Every lane has a KV stream of its own and keeps its KV after its session
ends, so recording costs nothing: an entry just names the first tokens of a lane. A new
request that leased an entry starts in that lane when it is idle (the hit is free), or
gets the lane's KV copied into its own. A lane with entries is only given to another
request after its longest entry was saved to host RAM (or dropped, when the host tier is
off or the entry too short to be worth it).

Every method but :meth:`stats` runs on the worker thread (the only thread allowed to call
the runtime); :meth:`stats` reads a value the worker replaces atomically, so the HTTP and
control threads may call it at any time. A request's :class:`Lease` is kept by the
request (the worker's record of it), not here: the cache only pins the entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from skippyd.engine.policy import CacheAffinity, StageCacheAffinity
from skippyd.engine.prefix_cache.cache_settings import (
    HOST_RESTORE_COST_DIVISOR,
    PREFILL_COST_PER_TOKEN,
    PrefixCacheSettings,
)
from skippyd.engine.prefix_cache.entries import (
    CacheEntry,
    CacheMatch,
    EntryTable,
    PrefixCacheStats,
    Tier,
    host_cost,
    state_nbytes,
)
from skippyd.engine.prefix_cache.eviction import count_victims, host_victims
from skippyd.engine.runtime.contract import LanesBusyError, Runtime
from skippyd.engine.telemetry_events import PrefixCacheChanged, TelemetryPayload

logger = logging.getLogger(__name__)


Publish = Callable[[TelemetryPayload], None]


@dataclass(frozen=True, slots=True)
class Lease:
    """A request's claim on an entry, from lookup until the request leaves."""

    req_id: str
    entry_id: str
    tokens: tuple[int, ...]
    """The prompt prefix to restore."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request's session starts: a lane, and how much of its KV it keeps."""

    lane: int
    keep_tokens: int = 0
    """Leading tokens of the lane's KV that are the request's restored prefix."""


class LivePrefixCache:
    """The prefix cache of one stage; see the module docstring.

    Args:
        runtime: The runtime whose lanes hold resident entries.
        settings: Budgets and modes.
        namespace: Model and layer range the entries belong to.
        stage_index: This stage's index, for cache affinities.
        publish: Telemetry sink (the worker's hub).
    """

    def __init__(self, runtime: Runtime, settings: PrefixCacheSettings, *,
                 namespace: str, stage_index: int = 0, publish: Publish | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.namespace = namespace
        self.stage_index = stage_index
        self.table = EntryTable(settings)
        self._publish_fn = publish
        self._stats = PrefixCacheStats()

    # -- views (any thread) ---------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        """The latest counters (replaced by the worker after every change)."""
        return self._stats

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

        Counts a hit or a miss. The lease covers at most all but the last prompt token,
        which stays computed (its logits give the first generated token). The caller
        keeps the lease and hands it back to :meth:`release`.
        """
        prompt = tuple(prompt)
        match = self._fresh_match(prompt)
        restored = min(match.num_tokens, max(0, len(prompt) - 1))
        self.table.count_lookup(restored, len(prompt))
        if match.entry is None or restored == 0:
            self._refresh("lookup", tokens=0)
            return None
        self.table.touch(match.entry)
        match.entry.hits += 1
        match.entry.pins.add(req_id)
        lease = Lease(req_id, match.entry.id, prompt[:restored])
        self._refresh("lookup", tokens=restored, tier=match.entry.tier.value)
        return lease

    def _fresh_match(self, prompt: tuple[int, ...]) -> CacheMatch:
        """The best match whose entry is not stale (stale ones are dropped on the way)."""
        while True:
            match = self.table.match(prompt)
            if match.entry is None or self._is_current(match.entry):
                return match
            self._drop(match.entry, evicted=True)

    def _is_current(self, entry: CacheEntry) -> bool:
        """Whether a resident entry's lane still starts with its tokens."""
        if entry.tier is not Tier.RESIDENT or entry.lane is None:
            return entry.tier is Tier.HOST
        held = self.runtime.lane_history(entry.lane)
        return len(held) >= entry.num_tokens and held[:entry.num_tokens] == entry.tokens

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; idempotent."""
        entry = self.table.entries.get(lease.entry_id)
        if entry is not None:
            entry.pins.discard(lease.req_id)

    # -- placing and restoring ----------------------------------------------------------

    def place(self, lease: Lease | None) -> Placement:
        """Choose the idle lane a request (holding ``lease``, if any) starts in.

        Always the lowest idle lane: busy lanes then stay contiguous, and llama.cpp runs
        a batch of consecutive lanes as one micro-batch (a gap costs a second graph run
        every step). When that lane holds the request's leased prefix, the prefix is
        restored in place (after what the lane holds beyond it was saved); otherwise the
        lane's entries are first saved to host RAM, and the session starts empty (its
        prefix is then copied or loaded by :meth:`restore`).

        Raises:
            LanesBusyError: No lane is idle.
        """
        idle = self.runtime.idle_lanes()
        if not idle:
            raise LanesBusyError("no idle lane to place a request in")
        lowest = idle[0]
        entry = None if lease is None else self.table.entries.get(lease.entry_id)
        if (lease is not None and entry is not None and entry.lane == lowest
                and self._is_current(entry)):
            self.table.touch(entry)
            lane = entry.lane
            # The lane may hold more than the lease (a conversation that went on past a
            # shared system prompt): what the trim cuts off goes to host RAM first.
            self._vacate(lane, keep_tokens=len(lease.tokens))
            return Placement(lane, len(lease.tokens))
        self._vacate(lowest)
        return Placement(lowest)

    def restore(self, lease: Lease, session_id: str) -> bool:
        """Put the leased prefix into ``session_id``'s KV, unless it is there.

        Returns:
            True when the session now holds exactly the lease's tokens; False when the
            entry is gone or could not be loaded (the caller recomputes the prefix).
        """
        held = self.runtime.session_history(session_id)
        if held == lease.tokens:  # placed in the entry's own lane
            self._refresh("restore", tokens=len(lease.tokens), tier=Tier.RESIDENT.value)
            return True
        entry = self.table.entries.get(lease.entry_id)
        if entry is None or not self._is_current(entry):
            return False
        if entry.tier is Tier.RESIDENT:
            assert entry.lane is not None
            self.runtime.copy_lane_prefix(entry.lane, session_id, len(lease.tokens))
        elif not self._load(entry, session_id, len(lease.tokens)):
            return False
        self.table.touch(entry)
        self._refresh("restore", tokens=len(lease.tokens), tier=entry.tier.value)
        return True

    def _load(self, entry: CacheEntry, session_id: str, num_tokens: int) -> bool:
        """Load a host entry into the session and trim it to ``num_tokens``."""
        if entry.state is None:
            raise RuntimeError(f"host entry without a saved state: {entry.anon_repr()}")
        if not self.runtime.load_session_state(session_id, entry.state, entry.tokens):
            logger.info("host entry %s could not be loaded", entry.id)
            return False
        if num_tokens < entry.num_tokens:
            self.runtime.trim_session(session_id, num_tokens)
        return True

    # -- recording ------------------------------------------------------------------------

    def record(self, session_id: str, num_tokens: int) -> CacheEntry | None:
        """Record the first ``num_tokens`` tokens of the session's lane as an entry.

        Returns:
            The entry holding that prefix (maybe an existing one of the lane), or None
            when recording is off, the prefix is too short or the session unknown.
        """
        lane = self.runtime.lane_of(session_id)
        if not self.settings.record or num_tokens < self.settings.min_tokens or lane is None:
            return None
        tokens = self.runtime.session_history(session_id)[:num_tokens]
        if len(tokens) < num_tokens:
            return None
        existing = self.table.covers(tokens, lane)
        if existing is not None:
            self.table.touch(existing)
            return existing
        entry = self.table.add_resident(tokens, lane)
        if self.table.kv_bytes_per_token == 0:  # measured once, for the byte counters
            held = len(self.runtime.lane_history(lane))
            self.table.kv_bytes_per_token = self.runtime.lane_state_bytes(lane) // max(1, held)
        for shorter in self.table.superseded(entry):
            self._drop(shorter, evicted=False)
        for victim in count_victims(self.table, self.settings.max_entries, keep=entry):
            self._drop(victim, evicted=True)
        self._refresh("record", tokens=num_tokens, tier=Tier.RESIDENT.value)
        return entry

    # -- giving lanes up ------------------------------------------------------------------

    def _vacate(self, lane: int, keep_tokens: int = 0) -> None:
        """Before an idle lane is reused from ``keep_tokens`` on: keep its longest current
        entry that reaches past that point in host RAM (when the tier is on and the entry
        is worth a state), drop the others that do; shorter entries stay valid."""
        entries = [e for e in self.table.in_lane(lane) if e.num_tokens > keep_tokens]
        current = [entry for entry in entries if self._is_current(entry)]
        keep = current[0] if current and self._worth_saving(current[0]) else None
        for entry in entries:
            if entry is keep:
                self._demote(entry)
            else:
                self._drop(entry, evicted=True)

    def reclaim_one(self) -> int:
        """Give the shared KV pool the cells of one idle lane's kept KV.

        A lane without entries goes first, then the one whose entries were used least
        recently; its longest entry moves to host RAM like any lane given up.

        Returns:
            The cells freed (0 when no idle lane keeps anything).
        """
        held = [(lane, len(self.runtime.lane_history(lane))) for lane in self.runtime.idle_lanes()]
        held = [(lane, cells) for lane, cells in held if cells]
        if not held:
            return 0

        def recency(item: tuple[int, int]) -> int:
            entries = self.table.in_lane(item[0])
            return max((entry.last_used for entry in entries), default=-1)

        lane, cells = min(held, key=recency)
        self._vacate(lane)
        self.runtime.clear_lane(lane)
        return cells

    def _worth_saving(self, entry: CacheEntry) -> bool:
        return self.settings.host_tier and entry.num_tokens >= self.settings.min_tokens

    def _demote(self, entry: CacheEntry) -> None:
        """Save the entry's lane to host RAM and move the entry there (or drop it).

        The victims go first: the save may reuse one's mapping (the runtime's
        ``StateMappings``). That mapping may be a little longer than the state, so the
        budget is checked again with what the saved state really takes.
        """
        assert entry.lane is not None
        size = self.runtime.lane_state_bytes(entry.lane)
        bytes_needed = host_cost(size, entry.num_tokens)
        victims = host_victims(self.table, bytes_needed)
        if victims is None:
            self._drop(entry, evicted=True)
            return
        for victim in victims:
            self._drop(victim, evicted=True)
        state = self.runtime.save_lane_state(entry.lane, size)
        more = host_victims(self.table, host_cost(state_nbytes(state), entry.num_tokens))
        if more is None:
            state.release()
            self._drop(entry, evicted=True)
            return
        for victim in more:
            self._drop(victim, evicted=True)
        self.table.move_to_host(entry, state)
        self._refresh("demote", tokens=entry.num_tokens, tier=Tier.HOST.value)

    def _drop(self, entry: CacheEntry, *, evicted: bool) -> None:
        release = getattr(entry.state, "release", None)
        self.table.remove(entry, evicted=evicted)
        if release is not None:
            release()
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
        self._publish_fn(PrefixCacheChanged(operation, tokens, tier, self.table.epoch,
                                            tuple(stats.telemetry().items())))
