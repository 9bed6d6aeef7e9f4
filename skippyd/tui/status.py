"""``skippyd status`` and ``skippyd top --once``: one snapshot, on one screen or as JSON.

:func:`run_status` is the whole command: find the socket, ask for a snapshot, print it,
and map the outcome to an :class:`~skippyd.exitcodes.ExitCode`. :func:`render_status`
turns a snapshot (schema in ``docs/control-protocol.md``) into a rich renderable; it
reads every field tolerantly, so a snapshot from an older or newer daemon still renders.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from skippyd.config import ConfigError
from skippyd.control.client import ControlClient, ControlError, resolve_socket_path
from skippyd.exitcodes import ExitCode
from skippyd.tui.fmt import (
    fmt_bytes,
    fmt_duration,
    fmt_ms,
    fmt_percent,
    number,
    probe_line,
    section,
)

logger = logging.getLogger(__name__)

#: Limit for connecting and for the reply, each.
DEFAULT_TIMEOUT_S = 5.0
#: Busy lanes shown before the rest are summarised in one line.
MAX_LANE_ROWS = 16
_HEALTH_STYLE = {"ok": "bold green", "loading": "bold yellow", "draining": "bold yellow",
                 "degraded": "bold yellow", "failed": "bold red"}
_LATENCY_LABELS = {"ttft": "time to first token", "itl": "inter-token", "e2e": "end to end",
                   "queue": "queue time"}

Snapshot = Mapping[str, Any]


def run_status(socket: Path | None, config: Path | None, as_json: bool, *,
               out: Console | None = None, err: Console | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> ExitCode:
    """Print the status of a running stage.

    Args:
        socket: The control socket (``--socket``); else found from ``config`` or the
            default locations (:func:`~skippyd.control.client.resolve_socket_path`).
        config: The stage config whose ``control.socket`` to use.
        as_json: Print the raw snapshot as JSON instead of the summary.
        out: Where to print the snapshot (stdout by default).
        err: Where to print errors (stderr by default).
        timeout_s: Limit for connecting and for the reply.

    Returns:
        ``OK`` for a healthy stage, ``FAILURE`` for one that answered but is not
        serving, ``UNREACHABLE`` when nothing answered, ``CONFIG`` for a bad config.
    """
    out = out or Console()
    err = err or Console(stderr=True, soft_wrap=True)
    try:
        path = resolve_socket_path(socket, config)
        with ControlClient.connect(path, timeout_s) as client:
            snapshot = client.status()
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] invalid config {escape(exc.source or '')}\n{escape(str(exc))}",
                  highlight=False)
        return ExitCode.CONFIG
    except ControlError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return ExitCode.UNREACHABLE
    if as_json:
        # NOTE: plain text, never highlighted or wrapped: scripts parse it.
        out.out(json.dumps(snapshot, indent=2), highlight=False)
    else:
        out.print(render_status(snapshot))
    healthy = section(snapshot, "health").get("status") == "ok"
    return ExitCode.OK if healthy else ExitCode.FAILURE


def render_status(snapshot: Snapshot) -> RenderableType:
    """A one-screen summary of ``snapshot``; the link block only on a split stage."""
    parts = [_header(snapshot), Text(""), _lanes(snapshot), Text(""), _figures(snapshot),
             Text("")]
    link = section(snapshot, "link")
    if link:
        parts += [_link(link), Text("")]
    return Group(*parts, _latency(snapshot))


def _header(snap: Snapshot) -> Text:
    stage, health = section(snap, "stage"), section(snap, "health")
    roles = "+".join(role for role, on in (("first", stage.get("is_first")),
                                           ("final", stage.get("is_final"))) if on) or "middle"
    status = str(health.get("status", "?"))
    text = Text.assemble(
        ("skippyd ", "bold"), (f"stage {stage.get('id', '?')}", "bold cyan"),
        f"  #{stage.get('index', '?')} layers {stage.get('layer_start', '?')}:"
        f"{stage.get('layer_end', '?')} ({roles})  ",
        (str(stage.get("model", "?")), "magenta"), "\n", "health ",
        (status, _HEALTH_STYLE.get(status, "bold")),
    )
    if health.get("reason"):
        text.append(f" ({health['reason']})")
    text.append(f"   up {fmt_duration(number(snap.get('uptime_s')))}")
    return text


def _lanes(snap: Snapshot) -> RenderableType:
    rows = [row for row in snap.get("lanes") or () if isinstance(row, Mapping)]
    busy = [row for row in rows if row.get("phase") != "idle"]
    lane_count = int(number(snap.get("lane_count"), len(rows)))
    if not busy:
        return Text(f"lanes: all {lane_count} idle", style="bold")
    table = Table(title=f"lanes: {len(busy)} busy of {lane_count}", title_justify="left",
                  expand=False, show_edge=False, pad_edge=False)
    for name, justify in (("lane", "right"), ("phase", "left"), ("request", "left"),
                          ("prompt", "right"), ("generated", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in busy[:MAX_LANE_ROWS]:
        table.add_row(str(row.get("lane", "?")), str(row.get("phase", "?")),
                      _short(str(row.get("request_id") or "-")),
                      str(int(number(row.get("prompt_tokens")))),
                      str(int(number(row.get("generated_tokens")))))
    if len(busy) > MAX_LANE_ROWS:
        table.add_row("…", f"{len(busy) - MAX_LANE_ROWS} more busy lanes", "", "", "")
    return table


def _figures(snap: Snapshot) -> Table:
    grid = _grid()
    for label, value in _figure_rows(snap):
        grid.add_row(label, value)
    return grid


def _kv_layout(kv: Mapping[str, Any]) -> str:
    """How the lanes hold their KV and what one request may hold, e.g. ``one pool, up to
    8192 tokens a request``; empty for a daemon that does not say."""
    layout = {"unified": "one pool", "per_lane": "a stream per lane"}.get(
        str(kv.get("layout")), "")
    limit = int(number(kv.get("request_max_tokens")))
    if not layout:
        return ""
    return f"{layout}, up to {limit} tokens a request ·" if limit else f"{layout} ·"


def _figure_rows(snap: Snapshot) -> list[tuple[str, str]]:
    q, kv, wave = section(snap, "queues"), section(snap, "kv"), section(snap, "wave")
    tp, c = section(snap, "throughput"), section(snap, "counters")
    pc, sch = section(snap, "prefix_cache"), section(snap, "scheduler")
    fast = section(snap, "fast_paths")

    def n(mapping: Mapping[str, Any], key: str) -> int:
        return int(number(mapping.get(key)))

    direct = n(c, "direct_iterations")
    return [
        ("queues", f"waiting {n(q, 'waiting')} · commands {n(q, 'commands')} · "
                   f"direct {n(q, 'direct')}"),
        ("kv cells", f"{n(kv, 'cells_used')}/{n(kv, 'cells_total')} "
                     f"({fmt_percent(number(kv.get('usage')))}) {_kv_layout(kv)}  wave "
                     f"{n(wave, 'active_sessions')}/{n(wave, 'batch_size')}"
                     + (" full" if wave.get("full") else "")),
        ("throughput", f"prompt {number(tp.get('prompt_tok_s')):.1f} tok/s · generation "
                       f"{number(tp.get('generation_tok_s')):.1f} tok/s "
                       f"(last {number(tp.get('window_s')):.0f} s)"),
        ("requests", f"finished {n(c, 'finished')} · failed {n(c, 'failed')} · cancelled "
                     f"{n(c, 'cancelled')} · rejected {n(c, 'rejected')} · preempted "
                     f"{n(c, 'preempted')}"),
        ("tokens", f"prompt {n(c, 'prompt_tokens')} · generated {n(c, 'generation_tokens')}"
                   f" · iterations {n(c, 'iterations')}"
                   + (f" · direct iterations {direct}" if direct else "")),
        ("prefix cache", f"hits {n(pc, 'hits')} · misses {n(pc, 'misses')} "
                         f"({fmt_percent(number(pc.get('hit_rate')))}) · matched tokens "
                         f"{n(pc, 'matched_tokens')} · evictions {n(pc, 'evictions')} · "
                         f"resident {fmt_bytes(number(pc.get('bytes_resident')))} · host "
                         f"{fmt_bytes(number(pc.get('bytes_host')))}"),
        ("scheduler", f"last step {number(sch.get('last_step_ms')):.2f} ms"
                      + (f" (target {number(sch.get('step_target_ms')):.0f} ms)"
                         if number(sch.get('step_target_ms')) > 0 else "")
                      + " · overhead "
                      f"{number(sch.get('last_overhead_ms')):.2f} ms · overhead ratio "
                      f"{fmt_percent(number(sch.get('overhead_ratio')))}"),
        ("speculation", _speculation(section(snap, "speculation"))),
        ("fast paths", " · ".join(f"{name.replace('_', ' ')} {how}"
                                  for name, how in fast.items()) or "-"),
        ("offload", _offload(section(section(snap, "stage"), "offload"))),
    ]


def _speculation(spec: Mapping[str, Any]) -> str:
    """``ngram · drafted 120 · accepted 80 (66.7%)``, or ``off``."""
    mode = str(spec.get("mode") or "off")
    if mode == "off":
        return "off"
    return (f"{mode} · drafted {int(number(spec.get('drafted')))} · accepted "
            f"{int(number(spec.get('accepted')))} "
            f"({fmt_percent(number(spec.get('acceptance')))})")


def _offload(offload: Mapping[str, Any]) -> str:
    """Where the stage's layers run: ``CPU``, or how many go to which GPU."""
    layers = int(number(offload.get("gpu_layers")))
    backend = offload.get("gpu_backend")
    if not layers:
        return "CPU" + (" (a GPU backend is available)" if backend else "")
    if backend is False:
        return f"CPU: gpu_layers {layers} asked, but llama.cpp has no GPU backend"
    split = offload.get("tensor_split") or []
    return (f"GPU: {'all' if layers == -1 else layers} layers, main GPU "
            f"{int(number(offload.get('main_gpu')))}"
            + (f", split {','.join(f'{float(s):g}' for s in split)}" if split else ""))


def _link(link: Mapping[str, Any]) -> Table:
    """Stage 0 reports its chain to the later stages; a later stage, its listener."""
    grid = _grid()
    chain = section(link, "chain")
    rows = _chain_rows(link, chain) if chain else _listener_rows(link)
    for label, value in [*rows, ("link health", probe_line(link))]:
        grid.add_row(label, value)
    busy, uptime = number(link.get("busy_s")), number(link.get("uptime_s"))
    share = f" ({fmt_percent(busy / uptime)})" if uptime > 0 else ""
    grid.add_row("link busy", f"{busy:.2f} s of {uptime:.1f} s in llama.cpp{share}")
    return grid


def _chain_rows(link: Mapping[str, Any],
                chain: Mapping[str, Any]) -> list[tuple[str, str | Text]]:
    state = Text("up", style="bold green") if chain.get("up") else Text.assemble(
        ("down", "bold red"), f" ({chain['reason']})" if chain.get("reason") else "")
    return [
        ("link", Text.assemble("chain ", state, f" · {int(number(chain.get('num_stages')))}"
                               f" stages · epoch {int(number(chain.get('epoch')))}")),
        ("link traffic", f"sent {fmt_bytes(number(chain.get('bytes_out')))} · received "
                         f"{fmt_bytes(number(chain.get('bytes_in')))} · batches "
                         f"{int(number(link.get('batches_sent')))}"),
        ("look-ahead", f"hits {int(number(link.get('lookahead_hits')))} of "
                       f"{int(number(link.get('lookahead_steps')))} steps · retracted "
                       f"{int(number(link.get('lookahead_retracted')))}"),
    ]


def _listener_rows(link: Mapping[str, Any]) -> list[tuple[str, str | Text]]:
    return [
        ("link", f"connections {int(number(link.get('connections')))} "
                 f"({int(number(link.get('chains')))} open) · rejected "
                 f"{int(number(link.get('rejected')))} · active sessions "
                 f"{int(number(link.get('active_sessions')))}"),
        ("link traffic", f"received {fmt_bytes(number(link.get('bytes_in')))} · sent "
                         f"{fmt_bytes(number(link.get('bytes_out')))} · batches "
                         f"{int(number(link.get('batches')))}"),
    ]


def _latency(snap: Snapshot) -> Table:
    window = number(section(snap, "throughput").get("window_s"))
    table = Table(title=f"latency, ms (last {window:.0f} s)", title_justify="left",
                  show_edge=False, pad_edge=False)
    table.add_column("")
    for name in ("p50", "p95", "p99", "count"):
        table.add_column(name, justify="right")
    latency = section(snap, "latency_ms")
    for key, label in _LATENCY_LABELS.items():
        row = section(latency, key)
        if row:
            table.add_row(label, *(fmt_ms(row.get(p)) for p in ("p50", "p95", "p99")),
                          str(int(number(row.get("count")))))
    return table


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _short(request_id: str, width: int = 24) -> str:
    return request_id if len(request_id) <= width else request_id[:width - 1] + "…"
