"""The dashboard's small panels: header, queue depth, gauges, prefix cache, throughput, link.

Each widget takes the latest snapshot through a ``snapshot`` reactive that the app binds
with ``data_bind``, derives its numbers from it, and renders them. Layout, borders and
panel colours live in ``skippyd.tcss``; the only styling here marks values (health).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult, RenderResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline

from skippyd.tui.fmt import fmt_bytes, fmt_count, fmt_duration, link_lines, number, section

logger = logging.getLogger(__name__)

Snapshot = Mapping[str, Any] | None

_HEALTH_STYLES = {"ok": "bold green", "loading": "bold yellow", "draining": "bold yellow",
                  "failed": "bold red"}


class StageHeader(Widget):
    """One line: stage, model, layers, uptime, health and the connection state."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot (None before the first one)."""
    connection = reactive("connecting")
    """``connecting``, ``connected`` or ``disconnected``."""
    retry_in_s: reactive[float | None] = reactive(None)
    """Delay before the next connection attempt, while disconnected."""
    uptime_s = reactive(0.0)
    """Daemon uptime, advanced by the app's clock between snapshots."""
    paused = reactive(False)
    """Whether the display is frozen."""

    def __init__(self, socket_path: str, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None, disabled: bool = False) -> None:
        """A header for the daemon behind ``socket_path``.

        Args:
            socket_path: Shown until the first snapshot arrives.
            name: The widget's name.
            id: The widget's DOM id.
            classes: Its CSS classes.
            disabled: Whether it is disabled.
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.socket_path = socket_path

    def render(self) -> RenderResult:
        """Stage facts on the left, connection state on the right."""
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        grid.add_column(justify="right", no_wrap=True)
        grid.add_row(self._stage_text(), self._status_text())
        return grid

    def _stage_text(self) -> Text:
        if self.snapshot is None:
            return Text.assemble(("skippyd top ", "bold"), self.socket_path)
        stage = section(self.snapshot, "stage")
        health = section(self.snapshot, "health")
        status = str(health.get("status", "?"))
        text = Text.assemble(
            (f"{stage.get('id', '?')}", "bold"), f" #{stage.get('index', '?')} ",
            (f"{stage.get('model', '?')}", "italic"),
            f" L{stage.get('layer_start', '?')}-{stage.get('layer_end', '?')}",
            f" up {fmt_duration(self.uptime_s)} ", (status, _HEALTH_STYLES.get(status, "bold")),
        )
        if health.get("reason"):
            text.append(f" ({health['reason']})")
        return text

    def _status_text(self) -> Text:
        if self.paused:
            return Text(" PAUSED ", style="bold reverse")
        if self.connection == "disconnected":
            retry = f", retry {self.retry_in_s:.1f}s" if self.retry_in_s is not None else ""
            return Text(f" disconnected{retry}", style="bold red")
        if self.connection == "connected":
            return Text(" connected", style="green")
        return Text(" connecting…", style="yellow")


class QueueCounts(Widget):
    """The three queue lengths."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def render(self) -> RenderResult:
        queues = section(self.snapshot, "queues")
        waiting, commands, direct = (
            int(number(queues.get(key))) for key in ("waiting", "commands", "direct"))
        return Text(f"waiting {waiting}  commands {commands}\ndirect {direct}",
                    no_wrap=True, overflow="ellipsis")


class QueueDepth(Vertical):
    """Queue lengths plus a sparkline of the waiting queue."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""
    history: reactive[Sequence[float]] = reactive(())
    """Recent ``queues.waiting`` samples, oldest first."""
    waiting = reactive(0)
    """Requests waiting for a lane (derived from ``snapshot``)."""

    def compose(self) -> ComposeResult:
        yield QueueCounts(id="queue-counts").data_bind(QueueDepth.snapshot)
        yield Sparkline(id="queue-spark").data_bind(data=QueueDepth.history)

    def compute_waiting(self) -> int:
        return int(number(section(self.snapshot, "queues").get("waiting")))


class Gauge(Widget):
    """A labelled horizontal bar for a fraction in [0, 1]."""

    fraction = reactive(0.0)
    """Filled part; clamped to [0, 1]."""
    label = reactive("")
    """Short name left of the bar."""
    detail = reactive("")
    """Raw numbers right of the percentage."""

    MIN_BAR = 4
    """Narrowest bar, in cells."""

    def __init__(self, label: str, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None, disabled: bool = False) -> None:
        """A gauge named ``label``.

        Args:
            label: Short name left of the bar.
            name: The widget's name.
            id: The widget's DOM id.
            classes: Its CSS classes.
            disabled: Whether it is disabled.
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.label = label

    def validate_fraction(self, value: float) -> float:
        return min(1.0, max(0.0, value))

    def render(self) -> RenderResult:
        """``label ██████░░░░ 62% detail``, the bar taking the free width.

        The detail is left out when it would squeeze the bar below ``MIN_BAR``.
        """
        tail = f" {self.fraction * 100:3.0f}%"
        if self.size.width - len(self.label) - len(tail) - len(self.detail) - 2 >= self.MIN_BAR:
            tail = f"{tail} {self.detail}"
        width = max(self.MIN_BAR, self.size.width - len(self.label) - len(tail) - 1)
        filled = round(self.fraction * width)
        return Text.assemble(f"{self.label} ", ("█" * filled, "bold"),
                             ("░" * (width - filled), "dim"), tail, no_wrap=True)


class WaveFullness(Gauge):
    """How full the current decode wave is (``wave.fullness``)."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        wave = section(snapshot, "wave")
        self.fraction = number(wave.get("fullness"))
        full = " full" if wave.get("full") else ""
        self.detail = (f"{int(number(wave.get('active_sessions')))}"
                       f"/{int(number(wave.get('batch_size')))}{full}")


class KvUsage(Gauge):
    """How many KV cells are in use (``kv.usage``)."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        kv = section(snapshot, "kv")
        self.fraction = number(kv.get("usage"))
        self.detail = (f"{fmt_count(number(kv.get('cells_used')))}"
                       f"/{fmt_count(number(kv.get('cells_total')))}")


class StepLine(Widget):
    """The worker's last step time and its overhead (the snapshot's ``scheduler`` section)."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def render(self) -> RenderResult:
        scheduler = section(self.snapshot, "scheduler")
        target = number(scheduler.get("step_target_ms"))
        spec = section(self.snapshot, "speculation")
        drafting = (f"  spec {number(spec.get('acceptance')) * 100:.0f}%"
                    if str(spec.get("mode") or "off") != "off" else "")
        return Text(f"step {number(scheduler.get('last_step_ms')):.1f}"
                    + (f"/{target:.0f}" if target > 0 else "") + "ms  "
                    f"ovh {number(scheduler.get('overhead_ratio')) * 100:.0f}%" + drafting,
                    no_wrap=True)


class CacheHits(Widget):
    """Prefix-cache hit rate and counts."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""
    hit_rate = reactive(0.0)
    """Hits / lookups in [0, 1] (derived from ``snapshot``)."""

    def compute_hit_rate(self) -> float:
        return min(1.0, max(0.0, number(section(self.snapshot, "prefix_cache").get("hit_rate"))))

    def render(self) -> RenderResult:
        cache = section(self.snapshot, "prefix_cache")
        return Text(
            f"hit {self.hit_rate * 100:.1f}%  {fmt_count(number(cache.get('hits')))}"
            f"/{fmt_count(number(cache.get('hits')) + number(cache.get('misses')))}\n"
            f"matched {fmt_count(number(cache.get('matched_tokens')))} tok"
            f"  ev {fmt_count(number(cache.get('evictions')))}\n"
            f"res {fmt_bytes(number(cache.get('bytes_resident')))}"
            f"  host {fmt_bytes(number(cache.get('bytes_host')))}",
            no_wrap=True, overflow="ellipsis",
        )


class Rate(Widget):
    """One ``throughput`` figure in tokens per second."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def __init__(self, key: str, label: str, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None, disabled: bool = False) -> None:
        """Show ``throughput[key]`` after ``label``.

        Args:
            key: Field of the snapshot's ``throughput`` object.
            label: Text shown before the number.
            name: The widget's name.
            id: The widget's DOM id.
            classes: Its CSS classes.
            disabled: Whether it is disabled.
        """
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self.key = key
        self.label = label

    def render(self) -> RenderResult:
        rate = number(section(self.snapshot, "throughput").get(self.key))
        return Text(f"{self.label} {rate:.1f} tok/s", no_wrap=True)


class Throughput(Vertical):
    """Prompt and generation tokens per second, each with a sparkline."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""
    prompt_history: reactive[Sequence[float]] = reactive(())
    """Recent ``throughput.prompt_tok_s`` samples."""
    generation_history: reactive[Sequence[float]] = reactive(())
    """Recent ``throughput.generation_tok_s`` samples."""

    def compose(self) -> ComposeResult:
        yield Rate("prompt_tok_s", "prompt", id="prompt-rate").data_bind(Throughput.snapshot)
        yield Sparkline(id="prompt-spark").data_bind(data=Throughput.prompt_history)
        yield Rate("generation_tok_s", "gen   ", id="generation-rate").data_bind(
            Throughput.snapshot)
        yield Sparkline(id="generation-spark").data_bind(data=Throughput.generation_history)


class LinkPanel(Widget):
    """A split stage's link: the chain (stage 0) or the upstream traffic (later stages).

    Shown only while the snapshot has a ``link`` section: a stage serving a whole model
    has none, and an empty panel would only take rows from the lanes and events.
    """

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""
    busy_fraction: reactive[float | None] = reactive(None)
    """The stage's share of time in llama.cpp between two snapshots (None: unknown)."""

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        self.display = bool(section(snapshot, "link"))

    def render(self) -> RenderResult:
        link = section(self.snapshot, "link")
        if not link:
            return Text("")
        text = Text("\n".join(link_lines(link, self.busy_fraction)), no_wrap=True,
                    overflow="ellipsis")
        text.highlight_regex(r"^chain up\b", "bold green")
        text.highlight_regex(r"^chain down\b", "bold red")
        return text
