"""``skippyd top --once [--json]``: print one snapshot and exit (for scripts).

With ``--json`` the raw snapshot object is printed as JSON; otherwise a compact rich
rendering of the same panels as the dashboard.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from skippyd.tui.fmt import (
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_ms,
    fmt_percent,
    link_lines,
    number,
    section,
)
from skippyd.tui.source import DEFAULT_TIMEOUT_S, ControlError, fetch_snapshot

logger = logging.getLogger(__name__)

#: Exit code when the daemon cannot be reached or answers badly.
EXIT_UNREACHABLE = 1


def run_once(
    path: Path,
    as_json: bool,
    *,
    out: Console | None = None,
    err: Console | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Fetch one snapshot from ``path`` and print it.

    Args:
        path: The daemon's control socket.
        as_json: Print the raw snapshot as JSON instead of a rendering.
        out: Console for the snapshot; stdout by default.
        err: Console for errors; stderr by default.
        timeout_s: Limit for connecting and for the reply.

    Returns:
        0 on success, :data:`EXIT_UNREACHABLE` when no snapshot could be had.
    """
    out = out or Console()
    err = err or Console(stderr=True)
    try:
        snapshot = asyncio.run(fetch_snapshot(path, timeout_s))
    except ControlError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return EXIT_UNREACHABLE
    if as_json:
        # NOTE: plain text, never highlighted or wrapped: scripts parse it.
        out.out(json.dumps(snapshot, indent=2), highlight=False)
    else:
        out.print(render_snapshot(snapshot))
    return 0


def render_snapshot(snapshot: Mapping[str, Any]) -> RenderableType:
    """A compact rendering of a snapshot: a key/value table, then the lanes."""
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="bold", no_wrap=True)
    rows.add_column()
    for key, value in _summary_rows(snapshot):
        rows.add_row(key, value)
    return Group(_title(snapshot), rows, _lanes_table(snapshot))


def _title(snapshot: Mapping[str, Any]) -> Text:
    stage = section(snapshot, "stage")
    health = section(snapshot, "health")
    reason = f" ({health['reason']})" if health.get("reason") else ""
    return Text(
        f"{stage.get('id', '?')} #{stage.get('index', '?')}  {stage.get('model', '?')}"
        f"  layers {stage.get('layer_start', '?')}-{stage.get('layer_end', '?')}"
        f"  up {fmt_duration(number(snapshot.get('uptime_s')))}"
        f"  {health.get('status', '?')}{reason}", style="bold")


def _summary_rows(snapshot: Mapping[str, Any]) -> list[tuple[str, str]]:
    queues, wave, kv = (section(snapshot, key) for key in ("queues", "wave", "kv"))
    cache, rate = section(snapshot, "prefix_cache"), section(snapshot, "throughput")
    scheduler, counters = section(snapshot, "scheduler"), section(snapshot, "counters")
    return [
        ("queues", "  ".join(f"{key} {int(number(queues.get(key)))}"
                             for key in ("waiting", "commands", "direct"))),
        ("wave", f"{int(number(wave.get('active_sessions')))}/{int(number(wave.get('batch_size')))}"
                 f" ({fmt_percent(number(wave.get('fullness')))})"
                 + ("  full" if wave.get("full") else "")),
        ("kv", f"{int(number(kv.get('cells_used')))}/{int(number(kv.get('cells_total')))} cells"
               f" ({fmt_percent(number(kv.get('usage')))})"),
        ("prefix cache", f"hit {fmt_percent(number(cache.get('hit_rate')))}"
                         f"  hits {int(number(cache.get('hits')))}"
                         f"  misses {int(number(cache.get('misses')))}"
                         f"  matched {fmt_count(number(cache.get('matched_tokens')))} tok"
                         f"  evictions {int(number(cache.get('evictions')))}"
                         f"  resident {fmt_bytes(number(cache.get('bytes_resident')))}"
                         f"  host {fmt_bytes(number(cache.get('bytes_host')))}"),
        ("tok/s", f"prompt {number(rate.get('prompt_tok_s')):.1f}"
                  f"  generation {number(rate.get('generation_tok_s')):.1f}"
                  f"  (over {number(rate.get('window_s')):.0f} s)"),
        *_latency_rows(section(snapshot, "latency_ms")),
        ("scheduler", f"step {number(scheduler.get('last_step_ms')):.1f} ms"
                      f"  overhead {number(scheduler.get('last_overhead_ms')):.1f} ms"
                      f" ({fmt_percent(number(scheduler.get('overhead_ratio')))})"),
        ("counters", "  ".join(f"{key} {int(number(value))}" for key, value in counters.items())),
        *_link_rows(section(snapshot, "link")),
    ]


def _link_rows(link: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The dashboard's link lines on a split stage; one snapshot gives no busy fraction."""
    if not link:
        return []
    first, *rest = link_lines(link, None)
    return [("link", first), *(("", line) for line in rest)]


def _latency_rows(latency: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for metric in ("ttft", "itl", "e2e"):
        stats = latency.get(metric) if isinstance(latency.get(metric), Mapping) else {}
        rows.append((f"{metric} ms", "  ".join(
            f"{column} {fmt_ms(stats.get(column))}" for column in ("p50", "p95", "p99"))
            + f"  n {int(number(stats.get('count')))}"))
    return rows


def _lanes_table(snapshot: Mapping[str, Any]) -> RenderableType:
    lanes = [lane for lane in snapshot.get("lanes") or () if isinstance(lane, Mapping)]
    table = Table("lane", "phase", "request", "prompt", "gen", box=None, padding=(0, 1),
                  title=f"lanes ({int(number(snapshot.get('lane_count')))})",
                  title_justify="left")
    for lane in lanes:
        table.add_row(str(lane.get("lane", "?")), str(lane.get("phase", "?")),
                      str(lane.get("request_id") or "-"),
                      str(int(number(lane.get("prompt_tokens")))),
                      str(int(number(lane.get("generated_tokens")))))
    return table
