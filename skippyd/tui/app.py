"""``skippyd top``: a live Textual dashboard of one daemon's control socket.

The app composes the panels and binds its reactives into them; ``skippyd.tcss`` lays
them out. One exclusive async worker follows the socket (:class:`ControlFeed`) and only
records what arrives in a :class:`DashboardState` and sets a dirty flag; a
``set_interval`` tick copies the state into the reactives, so a burst of telemetry costs
one repaint. While paused (``p``) the socket is still read and the state kept current
(events are buffered, up to a bound), but nothing on screen changes except the
connection status; resuming shows the latest data and the buffered events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.widget import Widget
from textual.widgets import Footer, Input

from skippyd.tui.help import HelpScreen
from skippyd.tui.source import DEFAULT_INTERVAL_MS, ControlFeed
from skippyd.tui.state import DashboardState
from skippyd.tui.tables import EventLog, LanesTable, LatencyTable
from skippyd.tui.widgets import (
    CacheHits,
    KvUsage,
    LinkPanel,
    QueueDepth,
    StageHeader,
    StepLine,
    Throughput,
    WaveFullness,
)

logger = logging.getLogger(__name__)

W = TypeVar("W", bound=Widget)

#: Seconds between repaint ticks.
DEFAULT_REPAINT_S = 0.25


class TopApp(App[None]):
    """The live dashboard of one skippyd control socket.

    Args:
        socket_path: The daemon's control socket.
        interval_ms: Snapshot period to subscribe with.
        feed: The connection to follow; built from ``socket_path`` when None (leave
            as default unless testing, e.g. to shorten the reconnect backoff).
        clock: Monotonic clock in seconds; leave as default unless testing.
        repaint_s: Seconds between repaint ticks.
    """

    CSS_PATH = "skippyd.tcss"
    TITLE = "skippyd top"
    AUTO_FOCUS = "#events"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "toggle_steps", "Steps"),
        Binding("question_mark", "help", "Help"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | q | Quit. |
    | p | Pause or resume the display (data keeps being read). |
    | / | Open the event filter input. |
    | s | Show or hide the per-step events (with ``telemetry.level = "debug"``). |
    | ? | Show the help screen. |
    | escape | Clear the event filter and close its input. |
    """

    snapshot: var[Mapping[str, Any] | None] = var(None)
    """The latest snapshot shown."""
    connection = var("connecting")
    """``connecting``, ``connected`` or ``disconnected``."""
    retry_in_s: var[float | None] = var(None)
    """Delay before the next connection attempt, while disconnected."""
    uptime_s = var(0.0)
    """The daemon's uptime, advanced by ``clock`` between snapshots."""
    paused = var(False)
    """Whether the display is frozen."""
    queue_history: var[Sequence[float]] = var(())
    """Recent waiting-queue samples."""
    prompt_history: var[Sequence[float]] = var(())
    """Recent prompt tok/s samples."""
    generation_history: var[Sequence[float]] = var(())
    """Recent generation tok/s samples."""
    busy_fraction: var[float | None] = var(None)
    """A split stage's share of time in llama.cpp between its last two snapshots."""
    event_filter = var("")
    """The event log filter (see :func:`skippyd.tui.state.event_matches`)."""
    show_steps = var(False)
    """Whether the event log shows the per-step events too."""
    num_dropped = var(0)
    """Events lost because the daemon or the dashboard fell behind."""

    def __init__(
        self,
        socket_path: Path,
        *,
        interval_ms: int = DEFAULT_INTERVAL_MS,
        feed: ControlFeed | None = None,
        clock: Callable[[], float] = time.monotonic,
        repaint_s: float = DEFAULT_REPAINT_S,
    ) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.feed = feed or ControlFeed(socket_path, interval_ms=interval_ms)
        self.state = DashboardState()
        self._clock = clock
        self._repaint_s = repaint_s
        self._dirty = False
        self.sub_title = str(socket_path)
        # NOTE: kept, not queried: App.query_one searches the active screen, which may
        # be the help screen (or none while the app shuts down).
        self._event_log = EventLog(id="events", classes="panel")
        self._filter_input = Input(
            placeholder="filter events: glob on name or substring; enter keeps, escape clears",
            id="filter", compact=True)

    def compose(self) -> ComposeResult:
        yield StageHeader(str(self.socket_path), id="header").data_bind(
            TopApp.snapshot, TopApp.connection, TopApp.retry_in_s, TopApp.uptime_s,
            TopApp.paused)
        with Horizontal(id="row-top"):
            yield _titled(QueueDepth(id="queue", classes="panel").data_bind(
                TopApp.snapshot, history=TopApp.queue_history), "queue")
            with _titled(Vertical(id="load", classes="panel"), "wave · kv"):
                yield WaveFullness("wave", id="wave").data_bind(TopApp.snapshot)
                yield KvUsage("kv  ", id="kv").data_bind(TopApp.snapshot)
                yield StepLine(id="scheduler").data_bind(TopApp.snapshot)
            yield _titled(CacheHits(id="cache", classes="panel").data_bind(TopApp.snapshot),
                          "prefix cache")
        with Horizontal(id="row-mid"):
            yield _titled(Throughput(id="throughput", classes="panel").data_bind(
                TopApp.snapshot, TopApp.prompt_history, TopApp.generation_history),
                "throughput")
            yield _titled(LatencyTable(id="latency", classes="panel").data_bind(
                TopApp.snapshot), "latency (60 s)")
        yield _titled(LinkPanel(id="link", classes="panel").data_bind(
            TopApp.snapshot, TopApp.busy_fraction), "link")
        with Horizontal(id="row-bottom"):
            yield _titled(LanesTable(id="lanes", classes="panel").data_bind(TopApp.snapshot),
                          "lanes")
            yield _titled(self._event_log.data_bind(
                TopApp.num_dropped, pattern=TopApp.event_filter, detail=TopApp.show_steps),
                "events")
        yield self._filter_input
        yield Footer()

    def on_mount(self) -> None:
        self.follow_feed()
        self.set_interval(self._repaint_s, self.repaint)

    @work(exclusive=True, group="feed")
    async def follow_feed(self) -> None:
        """Read the control socket forever; record items, repaint later."""
        async for item in self.feed.follow():
            self.state.apply(item, self._clock())
            self._dirty = True

    def repaint(self) -> None:
        """Copy the state into the reactives (the connection status even while paused)."""
        state = self.state
        self.connection, self.retry_in_s = state.connection, state.retry_in_s
        if self.paused:
            return
        self.uptime_s = float(int(state.uptime_s(self._clock())))  # repaint once a second
        if not self._dirty:
            return
        self._dirty = False
        self.snapshot = state.snapshot
        self.queue_history = tuple(state.queue_history)
        self.prompt_history = tuple(state.prompt_history)
        self.generation_history = tuple(state.generation_history)
        self.busy_fraction = state.busy_fraction
        self.num_dropped = state.num_dropped
        events = state.take_events()
        if events:
            self._event_log.add_events(events)

    def watch_connection(self, connection: str) -> None:
        # NOTE: on the app, not self.screen, which may be the help screen.
        self.set_class(connection == "disconnected", "-disconnected")

    def action_toggle_pause(self) -> None:
        """Freeze or unfreeze the display."""
        self.paused = not self.paused
        if not self.paused:
            self._dirty = True
            self.repaint()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The filter keys work on the dashboard only, not over the help screen."""
        if action in ("filter", "clear_filter"):
            return not isinstance(self.screen, HelpScreen)
        return True

    def action_toggle_steps(self) -> None:
        """Show or hide the per-step events in the log."""
        self.show_steps = not self.show_steps

    def action_filter(self) -> None:
        """Show the filter input and focus it."""
        self._filter_input.add_class("-visible")
        self._filter_input.focus()

    def action_clear_filter(self) -> None:
        """Clear the filter and hide its input."""
        self._filter_input.value = ""
        self.event_filter = ""
        self._hide_filter()

    def action_help(self) -> None:
        """Show the key help."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        """Filter the event log as the user types."""
        self.event_filter = event.value

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self) -> None:
        """Keep the filter and hide the input."""
        self._hide_filter()

    def _hide_filter(self) -> None:
        self._filter_input.remove_class("-visible")
        self._event_log.focus()


def _titled(widget: W, title: str) -> W:
    """Set a widget's border title and return it (for use inside ``compose``)."""
    widget.border_title = title
    return widget
