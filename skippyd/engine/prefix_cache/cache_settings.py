"""Prefix-cache settings derived from ``[kv_cache]``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Modelled cost of computing one prompt token, in the lab's units (µs).
PREFILL_COST_PER_TOKEN = 2
#: Share of the prefill cost a host-RAM restore still costs (a state copy, not compute).
HOST_RESTORE_COST_DIVISOR = 8


@dataclass(frozen=True, slots=True)
class PrefixCacheSettings:
    """What the live prefix cache may do; built by :func:`settings_from_config`."""

    lookup: bool = True
    """Restore cached prefixes into new requests (``auto`` and ``lookup-record``)."""
    record: bool = True
    """Record prefixes of finished and in-flight requests."""
    host_tier: bool = True
    """Keep evicted entries as saved sequence states in host RAM."""
    max_entries: int = 64
    """Most entries kept, in idle lanes and in host RAM together."""
    host_ram_bytes: int = 256 << 20
    """Budget of the host-RAM tier."""
    min_tokens: int = 64
    """Shortest prefix worth recording or restoring."""
    shared_prefix_stride_tokens: int = 128
    """A shared-prefix record must extend what is cached by at least this much."""
    shared_prefix_record_limit: int = 2
    """Most shared-prefix records taken from one in-flight request."""



def settings_from_config(kv_cache, *, supported: bool, reason: str = "") -> PrefixCacheSettings | None:
    """Turn a ``KvCacheSection`` into settings; None when the cache stays off.

    Args:
        kv_cache: The ``[kv_cache]`` section.
        supported: Whether this stage can run the cache (an unsplit, attention-only model).
        reason: Why it cannot, for the log line.
    """
    if kv_cache.mode == "disabled" or kv_cache.max_entries == 0:
        return None
    if not supported:
        if kv_cache.mode != "auto":
            logger.warning("kv_cache.mode = %s ignored: %s", kv_cache.mode, reason)
        return None
    payload = kv_cache.payload
    return PrefixCacheSettings(
        lookup=kv_cache.mode in ("auto", "lookup-record"),
        record=True,
        host_tier=payload in ("auto", "full-state") and kv_cache.host_ram_bytes > 0,
        max_entries=kv_cache.max_entries,
        host_ram_bytes=kv_cache.host_ram_bytes,
        min_tokens=kv_cache.min_tokens,
        shared_prefix_stride_tokens=kv_cache.shared_prefix_stride_tokens,
        shared_prefix_record_limit=kv_cache.shared_prefix_record_limit,
    )
