"""The dashboard's tabular panels: latency percentiles, lanes, and the event log.

The tables update their cells in place when the row set is unchanged, so a table keeps
its cursor and scroll position between snapshots. The event log keeps its own bounded
history, so changing the filter re-filters everything still held.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.text import Text
from textual.markup import escape
from textual.reactive import reactive
from textual.widgets import DataTable, Log

from skippyd.tui.fmt import fmt_count, fmt_ms, number, section
from skippyd.tui.state import EventLine, event_matches

logger = logging.getLogger(__name__)

Snapshot = Mapping[str, Any] | None

#: Latency metrics of the snapshot, in display order.
LATENCY_METRICS = ("ttft", "itl", "e2e")
#: Counters shown under the lanes table, with their short labels.
_COUNTERS = (("finished", "done"), ("failed", "fail"), ("cancelled", "cxl"),
             ("rejected", "rej"), ("preempted", "pre"))
_PHASE_STYLES = {"decode": "green", "prefill": "cyan", "recompute": "yellow", "idle": "dim"}
#: Width of the lanes table's request column; longer ids keep their (distinctive) end.
_REQUEST_ID_CHARS = 9


class LatencyTable(DataTable):
    """p50/p95/p99 and sample counts of TTFT, inter-token and end-to-end latency (ms)."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_column("ms", key="metric", width=4)
        for column in ("p50", "p95", "p99"):
            self.add_column(column, key=column, width=6)
        self.add_column("n", key="count", width=5)
        for metric in LATENCY_METRICS:
            self.add_row(metric, "-", "-", "-", "0", key=metric)
        self.watch_snapshot(self.snapshot)

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        if not self.row_count:
            return
        latency = section(snapshot, "latency_ms")
        for metric in LATENCY_METRICS:
            raw = latency.get(metric)
            stats: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
            for column in ("p50", "p95", "p99"):
                self.update_cell(metric, column, fmt_ms(stats.get(column)))
            self.update_cell(metric, "count", str(int(number(stats.get("count")))))


class LanesTable(DataTable):
    """One row per lane: phase, request and token counts; request counters below."""

    snapshot: reactive[Snapshot] = reactive(None)
    """The latest snapshot."""

    _COLUMNS = (("lane", "#", 2), ("phase", "phase", 7), ("request", "request", _REQUEST_ID_CHARS),
                ("prompt", "in", 5), ("gen", "out", 5))
    """Column key, label and width (fits a 40-column panel)."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        for key, label, width in self._COLUMNS:
            self.add_column(label, key=key, width=width)
        self.watch_snapshot(self.snapshot)

    def watch_snapshot(self, snapshot: Snapshot) -> None:
        if not self.columns:
            return
        lanes = snapshot.get("lanes") if snapshot is not None else None
        rows = [self._row(lane) for lane in lanes or () if isinstance(lane, Mapping)]
        keys = [row[0] for row in rows]
        if keys == [key.value for key in self.rows]:
            for row in rows:
                for (column, _, _), cell in zip(self._COLUMNS[1:], row[1:], strict=True):
                    self.update_cell(row[0], column, cell)
        else:
            self.clear()
            for row in rows:
                self.add_row(*row, key=row[0])
        self._show_counters(section(snapshot, "counters"))

    @staticmethod
    def _row(lane: Mapping[str, Any]) -> tuple[Any, ...]:
        phase = str(lane.get("phase", "?"))
        request = str(lane.get("request_id") or "-")
        if len(request) > _REQUEST_ID_CHARS:
            request = "…" + request[1 - _REQUEST_ID_CHARS:]
        return (str(lane.get("lane", "?")), Text(phase, style=_PHASE_STYLES.get(phase, "")),
                request, fmt_count(number(lane.get("prompt_tokens"))),
                fmt_count(number(lane.get("generated_tokens"))))

    def _show_counters(self, counters: Mapping[str, Any]) -> None:
        self.border_subtitle = " ".join(
            f"{label} {int(number(counters.get(key)))}" for key, label in _COUNTERS)


class EventLog(Log):
    """The telemetry event log, newest at the bottom, filtered by ``pattern``."""

    pattern = reactive("")
    """Filter: a glob on event names or a substring of the line (see ``event_matches``)."""
    detail = reactive(False)
    """Show the per-step events too (see ``event_matches``)."""
    num_dropped = reactive(0)
    """Events lost because the daemon or the dashboard fell behind."""

    def __init__(self, max_lines: int = 1000, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None, disabled: bool = False) -> None:
        """An empty log.

        Args:
            max_lines: Events kept (and re-filtered when ``pattern`` changes).
            name: The widget's name.
            id: The widget's DOM id.
            classes: Its CSS classes.
            disabled: Whether it is disabled.
        """
        super().__init__(max_lines=max_lines, auto_scroll=True, name=name, id=id,
                         classes=classes, disabled=disabled)
        self._events: deque[EventLine] = deque(maxlen=max_lines)

    @property
    def shown(self) -> Sequence[str]:
        """The lines currently displayed."""
        return self.lines

    def add_events(self, events: Iterable[EventLine]) -> None:
        """Keep ``events`` and show those that pass the filter."""
        events = list(events)
        self._events.extend(events)
        matching = [event.text for event in events
                    if event_matches(self.pattern, event, detail=self.detail)]
        if matching:
            self.write_lines(matching)

    def watch_pattern(self, pattern: str) -> None:
        self._refilter()

    def watch_detail(self, detail: bool) -> None:
        self._refilter()

    def _refilter(self) -> None:
        pattern = self.pattern
        title = "events + steps" if self.detail else "events"
        self.border_title = f"{title} ~ {escape(pattern)}" if pattern.strip() else title
        self.clear()
        self.write_lines([event.text for event in self._events
                          if event_matches(pattern, event, detail=self.detail)])

    def watch_num_dropped(self, num_dropped: int) -> None:
        self.border_subtitle = f"dropped {num_dropped}" if num_dropped else ""
