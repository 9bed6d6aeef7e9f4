"""Radix prefix cache over the KV idle lanes keep and saved sequence states.

* :mod:`.radix` indexes recorded token prefixes per namespace (model and layer range).
* :mod:`.entries` keeps the entries' tiers, lanes, pins, recency and counters.
* :mod:`.eviction` picks what gives way to the host-RAM and entry-count budgets.
* :mod:`.live` runs it all against a runtime's lanes.

The worker drives it (``worker/thread_cache.py``); the policy only sees the results: a
``PrefixRestore`` on a sequence and its ``CacheAffinity``. It never calls llama.cpp
itself, only the slot operations of the runtime it is given.
"""

from skippyd.engine.prefix_cache.cache_settings import PrefixCacheSettings, settings_from_config
from skippyd.engine.prefix_cache.entries import (
    CacheEntry,
    CacheMatch,
    EntryTable,
    PrefixCacheStats,
    Tier,
)
from skippyd.engine.prefix_cache.live import (
    Lease,
    LivePrefixCache,
    Placement,
)
from skippyd.engine.prefix_cache.radix import (
    PrefixIndex,
    RadixMatch,
    RadixTree,
    common_prefix_length,
)

__all__ = [
    "CacheEntry",
    "CacheMatch",
    "EntryTable",
    "Lease",
    "LivePrefixCache",
    "Placement",
    "PrefixCacheSettings",
    "PrefixCacheStats",
    "PrefixIndex",
    "RadixMatch",
    "RadixTree",
    "Tier",
    "common_prefix_length",
    "settings_from_config",
]
