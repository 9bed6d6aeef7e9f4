"""Which cache entries give way to a budget: pure functions over an :class:`EntryTable`.

Resident entries cost no memory of their own (they are KV an idle lane already holds),
so only two budgets bind: the host RAM of the host tier and the number of entries kept
(``max_entries``, which bounds the index and the bookkeeping). Both give way coldest
first, and never take an entry a request holds a lease on.
"""

from __future__ import annotations

import logging

from skippyd.engine.prefix_cache.entries import CacheEntry, EntryTable

logger = logging.getLogger(__name__)


def host_victims(table: EntryTable, new_bytes: int) -> list[CacheEntry] | None:
    """Unpinned host entries to drop, coldest first, so ``new_bytes`` fit the host budget.

    ``new_bytes`` is the incoming entry's whole host cost (see ``host_cost``).

    Returns:
        The victims (maybe none), or None when the state cannot fit at all.
    """
    budget = table.settings.host_ram_bytes
    hosted = table.host()
    pinned_bytes = sum(entry.host_bytes for entry in hosted if entry.pins)
    if pinned_bytes + new_bytes > budget:
        return None
    used = sum(entry.host_bytes for entry in hosted)
    victims = []
    for entry in sorted((e for e in hosted if not e.pins), key=lambda e: e.last_used):
        if used + new_bytes <= budget:
            break
        victims.append(entry)
        used -= entry.host_bytes
    return victims


def count_victims(table: EntryTable, max_entries: int, *,
                  keep: CacheEntry | None = None) -> list[CacheEntry]:
    """Unpinned entries to drop, coldest first, so at most ``max_entries`` remain.

    ``keep`` (the entry just recorded) is never chosen; pinned entries may leave the
    table over its bound until their requests leave.
    """
    excess = len(table.entries) - max(max_entries, 1)
    if excess <= 0:
        return []
    candidates = sorted((e for e in table.entries.values() if not e.pins and e is not keep),
                        key=lambda e: e.last_used)
    return candidates[:excess]
