"""Cache entries and their bookkeeping: tiers, lanes, pins, recency, counters.

An entry is one recorded token prefix. It lives in one of two tiers:

* **resident**: the first tokens of a lane's KV (every lane has a KV stream of its own
  and keeps it after its session ends); a hit starts the new session in that lane, or
  copies the lane's KV into another one.
* **host**: its lane was given to another session, but its KV was saved as a sequence
  state in host RAM first; a hit loads the state into a lane.

A resident entry is only as good as its lane: when the lane's KV no longer starts with
the entry's tokens (the lane was trimmed or reused) the entry is stale, which the live
cache checks before it relies on one.

:class:`EntryTable` is pure bookkeeping over one namespace; it never calls a runtime.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field

from skippyd.engine.prefix_cache.cache_settings import PrefixCacheSettings
from skippyd.engine.prefix_cache.radix import RadixTree

logger = logging.getLogger(__name__)

#: Host RAM a cached entry's token index costs per token besides its KV: its slot in the
#: entry's token tuple and in a radix edge, and the int object. Measured on CPython with
#: tracemalloc over 2 500 entries of 30-160 tokens: 50 B. It counts towards the host
#: tier's budget (with a small model's 512 B-per-token states it is a tenth of it).
INDEX_BYTES_PER_TOKEN = 50


class Tier(enum.Enum):
    """Where an entry's KV lives."""

    RESIDENT = "resident"
    HOST = "host"


@dataclass(eq=False, slots=True)
class CacheEntry:
    """One recorded prefix."""

    id: str
    tokens: tuple[int, ...]
    tier: Tier
    lane: int | None = None
    """The lane whose KV starts with the entry's tokens (resident tier)."""
    state: Sized | None = None
    """Saved sequence state (host tier), as the runtime saved it: ``nbytes`` (when it has
    one) or ``len()`` is the host RAM it takes."""
    last_used: int = 0
    """Recency stamp; smaller is colder."""
    hits: int = 0
    pins: set[str] = field(default_factory=set)
    """Requests holding a lease on this entry: it may not be dropped."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def host_bytes(self) -> int:
        """Host RAM the entry holds in the host tier: its saved state and token index."""
        return 0 if self.state is None else host_cost(state_nbytes(self.state), self.num_tokens)

    def anon_repr(self) -> str:
        """Describe the entry without its tokens."""
        return (f"CacheEntry(id={self.id}, tokens={self.num_tokens}, tier={self.tier.value}, "
                f"lane={self.lane}, pins={len(self.pins)})")


def state_nbytes(state: Sized) -> int:
    """Host RAM a saved state takes (a mapping counts whole pages)."""
    return int(getattr(state, "nbytes", len(state)))


def host_cost(state_bytes: int, num_tokens: int) -> int:
    """Host RAM an entry of ``num_tokens`` tokens takes with a ``state_bytes`` state."""
    return state_bytes + INDEX_BYTES_PER_TOKEN * num_tokens


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """The best entry for a prompt (a peek: recency untouched)."""

    num_tokens: int
    """Leading prompt tokens the entry can restore (0 below ``min_tokens``)."""
    entry: CacheEntry | None


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters and sizes; ``as_dict`` gives the keys the status snapshot reads."""

    hits: int = 0
    misses: int = 0
    matched_tokens: int = 0
    """Prompt tokens restored instead of computed, summed over hits."""
    queried_tokens: int = 0
    """Prompt tokens looked up, summed over every lookup: the token hit rate is
    ``matched_tokens / queried_tokens``."""
    bytes_resident: int = 0
    bytes_host: int = 0
    evictions: int = 0
    """Entries that left the pool (to host RAM or dropped) plus host entries dropped."""
    entries_resident: int = 0
    entries_host: int = 0
    records: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The status snapshot's ``prefix_cache`` section (exactly these keys)."""
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
                "matched_tokens": self.matched_tokens, "queried_tokens": self.queried_tokens,
                "bytes_resident": self.bytes_resident,
                "bytes_host": self.bytes_host, "evictions": self.evictions}

    def telemetry(self) -> dict[str, int | float]:
        """Everything, for telemetry events."""
        return {**self.as_dict(), "entries_resident": self.entries_resident,
                "entries_host": self.entries_host, "records": self.records}


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    matched_tokens: int = 0
    queried_tokens: int = 0
    evictions: int = 0
    records: int = 0


class EntryTable:
    """Entries of one namespace; see the module docstring.

    Args:
        settings: Budgets and thresholds.
    """

    def __init__(self, settings: PrefixCacheSettings) -> None:
        self.settings = settings
        self.index = RadixTree()
        self.entries: dict[str, CacheEntry] = {}
        self.counters = _Counters()
        self.epoch = 0
        """Bumped on every change of what is cached (stale-affinity detection)."""
        self.kv_bytes_per_token = 0
        """Measured at the first saved state; 0 until then."""
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)

    # -- lookups -----------------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> CacheMatch:
        """Best entry holding a prefix of ``prompt``: resident first, then the warmest."""
        found = self.index.match(prompt)
        if found.num_tokens < self.settings.min_tokens or not found.entry_ids:
            return CacheMatch(0, None)
        entries = [self.entries[entry_id] for entry_id in found.entry_ids]
        best = max(entries, key=lambda e: (e.tier is Tier.RESIDENT, e.last_used, e.id))
        return CacheMatch(found.num_tokens, best)

    def covers(self, tokens: Sequence[int], lane: int) -> CacheEntry | None:
        """An entry of ``lane`` holding all of ``tokens`` already, if any."""
        found = self.index.match(tokens)
        if found.num_tokens < len(tokens):
            return None
        return max((self.entries[i] for i in found.entry_ids
                    if self.entries[i].lane == lane), key=lambda e: e.last_used, default=None)

    def touch(self, entry: CacheEntry) -> None:
        """Mark ``entry`` as just used (LRU recency)."""
        entry.last_used = next(self._clock)

    def resident(self) -> list[CacheEntry]:
        return [e for e in self.entries.values() if e.tier is Tier.RESIDENT]

    def host(self) -> list[CacheEntry]:
        return [e for e in self.entries.values() if e.tier is Tier.HOST]

    def in_lane(self, lane: int) -> list[CacheEntry]:
        """Resident entries of ``lane``, longest first."""
        return sorted((e for e in self.entries.values() if e.lane == lane),
                      key=lambda e: -e.num_tokens)

    def host_bytes(self) -> int:
        return sum(entry.host_bytes for entry in self.entries.values())

    # -- changes -----------------------------------------------------------------------

    def add_resident(self, tokens: Sequence[int], lane: int) -> CacheEntry:
        """Index a new entry held by the first ``len(tokens)`` cells of ``lane``."""
        entry = CacheEntry(id=f"p{next(self._ids)}", tokens=tuple(tokens), tier=Tier.RESIDENT,
                           lane=lane)
        self.touch(entry)
        self.entries[entry.id] = entry
        self.index.insert(entry.tokens, entry.id)
        self.counters.records += 1
        self.epoch += 1
        return entry

    def move_to_host(self, entry: CacheEntry, state: Sized) -> None:
        """The entry's lane was saved to ``state`` (and is about to be reused)."""
        entry.lane = None
        entry.tier, entry.state = Tier.HOST, state
        self.counters.evictions += 1
        self.epoch += 1

    def remove(self, entry: CacheEntry, *, evicted: bool = True) -> None:
        """Forget ``entry``."""
        if self.entries.pop(entry.id, None) is None:
            return
        self.index.remove(entry.id)
        entry.lane = None
        entry.state = None
        if evicted:
            self.counters.evictions += 1
        self.epoch += 1

    def superseded(self, entry: CacheEntry) -> list[CacheEntry]:
        """Unpinned entries whose tokens resident ``entry`` starts with, and which only
        cost something: shorter entries of the same lane (a partial match into ``entry``
        restores the same prefix from the same cells) and host entries (host RAM)."""
        covered = []
        for other in self.entries.values():
            costly = other.lane == entry.lane or other.tier is Tier.HOST
            longest = entry.num_tokens - (other.tier is Tier.RESIDENT)
            if (other is not entry and costly and not other.pins
                    and other.num_tokens <= longest
                    and entry.tokens[:other.num_tokens] == other.tokens):
                covered.append(other)
        return covered

    # -- counters ----------------------------------------------------------------------

    def count_lookup(self, restored_tokens: int, prompt_tokens: int = 0) -> None:
        self.counters.queried_tokens += prompt_tokens
        if restored_tokens > 0:
            self.counters.hits += 1
            self.counters.matched_tokens += restored_tokens
        else:
            self.counters.misses += 1

    def stats(self) -> PrefixCacheStats:
        resident = self.resident()
        counters = self.counters
        return PrefixCacheStats(
            hits=counters.hits, misses=counters.misses, matched_tokens=counters.matched_tokens,
            queried_tokens=counters.queried_tokens,
            bytes_resident=sum(e.num_tokens for e in resident) * self.kv_bytes_per_token,
            bytes_host=self.host_bytes(), evictions=counters.evictions,
            entries_resident=len(resident), entries_host=len(self.entries) - len(resident),
            records=counters.records,
        )
