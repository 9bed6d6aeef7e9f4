"""``skippyd status``: one control-socket snapshot, rendered on one screen (or as JSON).

:func:`render_status` turns a snapshot (schema in ``docs/control-protocol.md``) into a
rich renderable; :func:`run_status` is the whole command: find the socket, ask for a
snapshot, print it, and map the outcome to an exit code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from skippyd.config import ConfigError
from skippyd.control.client import ControlClient, ControlError, resolve_socket_path
from skippyd.tui.fmt import fmt_bytes

logger = logging.getLogger(__name__)

#: Exit codes of ``skippyd status``.
EXIT_OK = 0
EXIT_NOT_SERVING = 1
"""The daemon answered, but its health is not ``ok`` (loading, draining, failed)."""
EXIT_UNREACHABLE = 2
"""No socket found, no answer, or a bad config."""
#: Busy lanes shown before the rest are summarised in one line.
MAX_LANE_ROWS = 16
_HEALTH_STYLE = {"ok": "bold green", "loading": "bold yellow", "draining": "bold yellow",
                 "failed": "bold red"}


def run_status(socket: Path | None, config: Path | None, as_json: bool, *,
               console: Console | None = None) -> int:
    """Print the status of a running stage.

    Args:
        socket: The control socket (``--socket``); else taken from ``config``.
        config: The stage config whose ``control.socket`` to use; else the defaults
            are probed.
        as_json: Print the raw snapshot as JSON instead of the summary.
        console: Where to print (stdout by default); errors go to stderr.

    Returns:
        :data:`EXIT_OK`, :data:`EXIT_NOT_SERVING` or :data:`EXIT_UNREACHABLE`.
    """
    out = console or Console()
    err = Console(stderr=True)
    try:
        path = resolve_socket_path(socket, config)
        with ControlClient.connect(path) as client:
            snapshot = client.status()
    except (ConfigError, ControlError) as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return EXIT_UNREACHABLE
    if as_json:
        out.out(json.dumps(snapshot, indent=2), highlight=False)
    else:
        out.print(render_status(snapshot))
    return EXIT_OK if snapshot.get("health", {}).get("status") == "ok" else EXIT_NOT_SERVING


def render_status(snapshot: dict[str, Any]) -> RenderableType:
    """A one-screen summary of ``snapshot``; the link block only on a split stage."""
    parts = [_header(snapshot), Text(""), _lanes(snapshot), Text(""), _figures(snapshot),
             Text("")]
    link = snapshot.get("link")
    if link:
        parts += [_link(link), Text("")]
    return Group(*parts, _latency(snapshot))


def _header(snap: dict[str, Any]) -> Text:
    stage, health = snap["stage"], snap["health"]
    roles = "+".join(r for r, on in (("first", stage["is_first"]), ("final", stage["is_final"]))
                     if on) or "middle"
    text = Text.assemble(
        ("skippyd ", "bold"), (f"stage {stage['id']}", "bold cyan"),
        f"  #{stage['index']} layers {stage['layer_start']}:{stage['layer_end']} ({roles})  ",
        (stage["model"], "magenta"), "\n", "health ",
        (health["status"], _HEALTH_STYLE.get(health["status"], "bold")),
    )
    if health.get("reason"):
        text.append(f" ({health['reason']})")
    text.append(f"   up {format_duration(snap['uptime_s'])}")
    return text


def _lanes(snap: dict[str, Any]) -> RenderableType:
    busy = [row for row in snap["lanes"] if row["phase"] != "idle"]
    if not busy:
        return Text(f"lanes: all {snap['lane_count']} idle", style="bold")
    table = Table(title=f"lanes: {len(busy)} busy of {snap['lane_count']}", title_justify="left",
                  expand=False, show_edge=False, pad_edge=False)
    for name, justify in (("lane", "right"), ("phase", "left"), ("request", "left"),
                          ("prompt", "right"), ("generated", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in busy[:MAX_LANE_ROWS]:
        table.add_row(str(row["lane"]), row["phase"], _short(row["request_id"]),
                      str(row["prompt_tokens"]), str(row["generated_tokens"]))
    if len(busy) > MAX_LANE_ROWS:
        table.add_row("…", f"{len(busy) - MAX_LANE_ROWS} more busy lanes", "", "", "")
    return table


def _figures(snap: dict[str, Any]) -> Table:
    q, kv, wave = snap["queues"], snap["kv"], snap["wave"]
    tp, c, pc, sch = snap["throughput"], snap["counters"], snap["prefix_cache"], snap["scheduler"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("queues", f"waiting {q['waiting']} · commands {q['commands']} · "
                 f"direct {q['direct']}")
    grid.add_row("kv cells", f"{kv['cells_used']}/{kv['cells_total']} ({kv['usage']:.1%})   "
                 f"wave {wave['active_sessions']}/{wave['batch_size']}"
                 + (" full" if wave["full"] else ""))
    grid.add_row("throughput", f"prompt {tp['prompt_tok_s']:.1f} tok/s · generation "
                 f"{tp['generation_tok_s']:.1f} tok/s (last {tp['window_s']:.0f} s)")
    grid.add_row("requests", f"finished {c['finished']} · failed {c['failed']} · cancelled "
                 f"{c['cancelled']} · rejected {c['rejected']} · preempted {c['preempted']}")
    direct = c.get("direct_iterations", 0)  # absent from daemons older than this view
    grid.add_row("tokens", f"prompt {c['prompt_tokens']} · generated {c['generation_tokens']}"
                 f" · iterations {c['iterations']}"
                 + (f" · direct iterations {direct}" if direct else ""))
    grid.add_row("prefix cache", f"hits {pc['hits']} · misses {pc['misses']} "
                 f"({pc['hit_rate']:.1%}) · matched tokens {pc['matched_tokens']}")
    grid.add_row("scheduler", f"last step {sch['last_step_ms']:.2f} ms · overhead "
                 f"{sch['last_overhead_ms']:.2f} ms · overhead ratio {sch['overhead_ratio']:.1%}")
    return grid


def _link(link: dict[str, Any]) -> Table:
    """Stage 0 reports its chain to the later stages; a later stage, its listener."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    chain = link.get("chain")
    rows = _chain_rows(link, chain) if chain is not None else _listener_rows(link)
    for label, value in rows:
        grid.add_row(label, value)
    busy, uptime = link["busy_s"], link["uptime_s"]
    share = f" ({busy / uptime:.1%})" if uptime > 0 else ""
    grid.add_row("link busy", f"{busy:.2f} s of {uptime:.1f} s in llama.cpp{share}")
    return grid


def _chain_rows(link: dict[str, Any], chain: dict[str, Any]) -> list[tuple[str, str]]:
    state = Text("up", style="bold green") if chain["up"] else Text.assemble(
        ("down", "bold red"), f" ({chain['reason']})" if chain.get("reason") else "")
    return [
        ("link", Text.assemble("chain ", state, f" · {chain['num_stages']} stages · epoch "
                                                f"{chain['epoch']}")),
        ("link traffic", f"sent {fmt_bytes(chain['bytes_out'])} · received "
                         f"{fmt_bytes(chain['bytes_in'])} · batches {link['batches_sent']}"),
        ("look-ahead", f"hits {link['lookahead_hits']} of {link['lookahead_steps']} steps · "
                       f"retracted {link['lookahead_retracted']}"),
    ]


def _listener_rows(link: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("link", f"connections {link['connections']} ({link['chains']} open) · rejected "
                 f"{link['rejected']} · active sessions {link['active_sessions']}"),
        ("link traffic", f"received {fmt_bytes(link['bytes_in'])} · sent "
                         f"{fmt_bytes(link['bytes_out'])} · batches {link['batches']}"),
    ]


def _latency(snap: dict[str, Any]) -> Table:
    table = Table(title=f"latency, ms (last {snap['throughput']['window_s']:.0f} s)",
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("")
    for name in ("p50", "p95", "p99", "count"):
        table.add_column(name, justify="right")
    labels = {"ttft": "time to first token", "itl": "inter-token", "e2e": "end to end",
              "queue": "queue time"}
    for key, label in labels.items():
        row = snap["latency_ms"].get(key)
        if row is not None:
            table.add_row(label, *(_ms(row[p]) for p in ("p50", "p95", "p99")),
                          str(row["count"]))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _short(request_id: str, width: int = 24) -> str:
    return request_id if len(request_id) <= width else request_id[:width - 1] + "…"


def format_duration(seconds: float) -> str:
    """``3723.4`` → ``"1h 02m 03s"``."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
