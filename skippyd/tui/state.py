"""What the dashboard knows, independent of how it is drawn.

:class:`DashboardState` absorbs feed items (cheaply: it is called for every line the
daemon sends) and keeps the latest snapshot, short histories for the sparklines, a split
stage's busy fraction (which needs two snapshots) and the events not yet shown. The app
copies it into widgets on its own repaint tick, so a burst of telemetry costs one
repaint, not one per event. Formatting and filtering of event lines live here too, so
they are testable without an app.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from skippyd.tui.fmt import number, section
from skippyd.tui.source import (
    Connected,
    Disconnected,
    Dropped,
    EventReceived,
    FeedItem,
    ServerError,
    SnapshotReceived,
)

logger = logging.getLogger(__name__)

#: Samples kept for each sparkline.
HISTORY_LEN = 120
#: Events kept between two repaints (and while paused); older ones are dropped.
MAX_PENDING_EVENTS = 2000
_GLOB_CHARS = frozenset("*?[")
#: Name of the dashboard's own log lines about its connection.
CONNECTION_EVENT = "top.connection"


@dataclass(frozen=True, slots=True)
class EventLine:
    """One telemetry event, formatted for the log."""

    name: str
    """Event name, matched by glob filters."""
    text: str
    """The whole line, matched by substring filters."""
    detail: bool = False
    """A per-step (debug) event, hidden unless asked for."""


def format_event(event: EventReceived) -> EventLine:
    """Format an event as ``HH:MM:SS.mmm name key=value ...``."""
    pairs = " ".join(f"{key}={_short(value)}" for key, value in event.attributes.items())
    return EventLine(event.name, f"{clock_text(event.ts)} {event.name} {pairs}".rstrip(),
                     detail=event.level == "debug")


def clock_text(ts: float) -> str:
    """Local wall-clock time of ``ts`` as ``HH:MM:SS.mmm``."""
    millis = int((ts % 1) * 1000)
    return f"{time.strftime('%H:%M:%S', time.localtime(ts))}.{millis:03d}"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def event_matches(pattern: str, line: EventLine, *, detail: bool = False) -> bool:
    """Whether ``line`` passes the event filter ``pattern``.

    An empty pattern passes every event but the per-step ones, which show with
    ``detail`` (or when a pattern names them). A pattern with glob characters (``*?[``)
    is matched against the full event name (``request.*``); any other pattern is a
    case-insensitive substring of the full name or of the shown line.
    """
    pattern = pattern.strip()
    if not pattern:
        return detail or not line.detail
    if _GLOB_CHARS.intersection(pattern):
        return fnmatch.fnmatchcase(line.name, pattern)
    needle = pattern.lower()
    return needle in line.name.lower() or needle in line.text.lower()


class DashboardState:
    """The latest view of one daemon, fed by :meth:`apply`.

    Connection changes are also logged as events named :data:`CONNECTION_EVENT`, so the
    log says why the dashboard is disconnected.

    Args:
        history_len: Samples kept per sparkline.
        max_pending_events: Events kept until :meth:`take_events`.
        wall_clock: Unix time for connection notes; leave as default unless testing.
    """

    def __init__(
        self,
        history_len: int = HISTORY_LEN,
        max_pending_events: int = MAX_PENDING_EVENTS,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.connection = "connecting"
        """``connecting``, ``connected`` or ``disconnected``."""
        self.server = ""
        """Server identification from the last hello."""
        self.reason = ""
        """Why the last connection ended or failed."""
        self.retry_in_s: float | None = None
        """Delay before the next attempt, while disconnected."""
        self.snapshot: Mapping[str, Any] | None = None
        """The latest snapshot (kept while disconnected, shown dimmed)."""
        self.received_at = 0.0
        """Clock reading when :attr:`snapshot` arrived."""
        self.num_dropped = 0
        """Items the daemon or this client dropped because the dashboard fell behind."""
        self.num_snapshots = 0
        """Snapshots received since start."""
        self.queue_history: deque[float] = deque(maxlen=history_len)
        self.prompt_history: deque[float] = deque(maxlen=history_len)
        self.generation_history: deque[float] = deque(maxlen=history_len)
        self.busy_fraction: float | None = None
        """Share of time a split stage spent in llama.cpp between its last two snapshots
        (from the link's ``busy_s`` and ``uptime_s``); None until there are two."""
        self._busy_sample: tuple[float, float] | None = None
        self._pending: deque[EventLine] = deque()
        self._max_pending = max_pending_events
        self._wall_clock = wall_clock

    def apply(self, item: FeedItem, now: float) -> None:
        """Absorb one feed item.

        Args:
            item: What the feed yielded.
            now: The dashboard clock's reading.
        """
        if isinstance(item, SnapshotReceived):
            self._apply_snapshot(item.snapshot, now)
        elif isinstance(item, EventReceived):
            self._add_event(format_event(item))
        elif isinstance(item, Dropped):
            self.num_dropped += item.count
        elif isinstance(item, Connected):
            self.connection, self.server, self.retry_in_s = "connected", item.server, None
            self._note(f"connected to {item.stage} ({item.server})")
        elif isinstance(item, Disconnected):
            if self.connection != "disconnected" or item.reason != self.reason:
                self._note(f"disconnected: {item.reason}")  # once, not on every retry
            self.connection, self.reason, self.retry_in_s = (
                "disconnected", item.reason, item.retry_in_s)
        elif isinstance(item, ServerError):
            logger.warning("control socket error %s: %s", item.code, item.message)

    def _apply_snapshot(self, snapshot: Mapping[str, Any], now: float) -> None:
        self.snapshot = snapshot
        self.received_at = now
        self.num_snapshots += 1
        queues = section(snapshot, "queues")
        throughput = section(snapshot, "throughput")
        self.queue_history.append(number(queues.get("waiting")))
        self.prompt_history.append(number(throughput.get("prompt_tok_s")))
        self.generation_history.append(number(throughput.get("generation_tok_s")))
        self._track_busy(snapshot.get("link"))

    def _track_busy(self, link: Any) -> None:
        """Update :attr:`busy_fraction` from the link counters of a new snapshot.

        A repeated snapshot (same uptime) keeps the fraction; a link that restarted
        (uptime went back) or disappeared starts over from one sample.
        """
        if not isinstance(link, Mapping):
            self._busy_sample = self.busy_fraction = None
            return
        sample = (number(link.get("uptime_s")), number(link.get("busy_s")))
        previous, self._busy_sample = self._busy_sample, sample
        if previous is None or sample[0] < previous[0]:
            self.busy_fraction = None
        elif sample[0] > previous[0]:
            fraction = (sample[1] - previous[1]) / (sample[0] - previous[0])
            self.busy_fraction = min(1.0, max(0.0, fraction))

    def _add_event(self, line: EventLine) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.num_dropped += 1
        self._pending.append(line)

    def _note(self, text: str) -> None:
        self._add_event(EventLine(CONNECTION_EVENT,
                                  f"{clock_text(self._wall_clock())} -- {text}"))

    def take_events(self) -> list[EventLine]:
        """Remove and return the events received since the last call, oldest first."""
        events = list(self._pending)
        self._pending.clear()
        return events

    def uptime_s(self, now: float) -> float:
        """The daemon's uptime, advanced by the time since the last snapshot while connected."""
        if self.snapshot is None:
            return 0.0
        base = number(self.snapshot.get("uptime_s"))
        if self.connection != "connected":
            return base
        return base + max(0.0, now - self.received_at)
