"""Pure helpers that read snapshot fields tolerantly and format numbers for the dashboard.

Used by the panels, by ``skippyd top --once`` and by ``skippyd status``; no Textual import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


def section(snapshot: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """``snapshot[key]`` if it is an object, else an empty mapping (tolerates gaps)."""
    if snapshot is None:
        return {}
    value = snapshot.get(key)
    return value if isinstance(value, Mapping) else {}


def number(value: Any, default: float = 0.0) -> float:
    """``value`` as a float; ``default`` for null or non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def fmt_count(value: float) -> str:
    """A count in at most ~5 characters: ``950``, ``12.3k``, ``4.5M``."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


def fmt_bytes(value: float) -> str:
    """A byte size with a binary unit: ``512 B``, ``1.5 MiB``."""
    for limit, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= limit:
            return f"{value / limit:.1f} {unit}"
    return f"{value:.0f} B"


def fmt_duration(seconds: float) -> str:
    """An uptime: ``42s``, ``3m07s``, ``1h02m``, ``2d03h``."""
    whole = int(max(0.0, seconds))
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def fmt_ms(value: Any) -> str:
    """A latency in milliseconds: ``-`` for null, seconds from 1000 ms up."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if value >= 1000:
        return f"{value / 1000:.2f}s"
    return f"{value:.1f}"


def fmt_percent(fraction: float) -> str:
    """A fraction in [0, 1] as ``62.5%``."""
    return f"{fraction * 100:.1f}%"


def link_lines(link: Mapping[str, Any], busy_fraction: float | None) -> list[str]:
    """A split stage's link in three lines that fit an 80-column panel.

    Stage 0 (its link has a ``chain``) shows the chain to the later stages; a later
    stage shows what its listener carried. ``busy_fraction`` is the stage's share of
    time in llama.cpp between two snapshots (``-`` while unknown). The third line has
    each connection's round trip and the stage's queue (see :func:`probe_line`).
    """
    return [*_traffic_lines(link, busy_fraction), probe_line(link)]


def probe_line(link: Mapping[str, Any]) -> str:
    """Round trips (average/maximum) of each connection and the stage's queue.

    A stage that is slow rather than dead shows here first: the round trips into it
    grow, and batches pile up in front of it (stage 0: unanswered batches; a later
    stage: batches read and not yet finished).
    """
    parts = []
    for view in link.get("links") or ():
        if not isinstance(view, Mapping):
            continue
        name = view.get("peer") if view.get("role") == "downstream" else view.get("role")
        rtt = f"{fmt_ms(view.get('rtt_avg_ms'))}/{fmt_ms(view.get('rtt_max_ms'))} ms"
        queued = number(view.get("send_queue_bytes"))
        parts.append(f"{name} {rtt}" + (f" (unsent {fmt_bytes(queued)})" if queued else ""))
    if "inflight_batches" in link:
        queue = (f"in flight {int(number(link.get('inflight_batches')))}"
                 f"/{int(number(link.get('max_inflight_batches')))}")
    else:
        queue = f"queued {int(number(link.get('queued_batches')))}"
    return "rtt " + (" · ".join(parts) if parts else "-") + f" · {queue}"


def _traffic_lines(link: Mapping[str, Any], busy_fraction: float | None) -> list[str]:
    fraction = "-" if busy_fraction is None else fmt_percent(busy_fraction)
    busy = f"busy {fraction} ({number(link.get('busy_s')):.2f} s)"
    chain = link.get("chain")
    if isinstance(chain, Mapping):
        state = "up" if chain.get("up") else "down"
        return [f"chain {state} · {int(number(chain.get('num_stages')))} stages"
                f" · epoch {int(number(chain.get('epoch')))} · {busy}",
                f"sent {fmt_bytes(number(chain.get('bytes_out')))}"
                f" · received {fmt_bytes(number(chain.get('bytes_in')))}"
                f" · look-ahead {fmt_count(number(link.get('lookahead_hits')))}"
                f"/{fmt_count(number(link.get('lookahead_steps')))} hits"]
    return [f"connections {fmt_count(number(link.get('connections')))}"
            f" ({int(number(link.get('chains')))} open)"
            f" · rejected {fmt_count(number(link.get('rejected')))}"
            f" · active sessions {int(number(link.get('active_sessions')))}",
            f"received {fmt_bytes(number(link.get('bytes_in')))}"
            f" · sent {fmt_bytes(number(link.get('bytes_out')))} · {busy}"]
