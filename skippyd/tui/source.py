"""The dashboard's connection to a daemon's control socket (protocol v1).

:class:`ControlFeed` follows one socket for as long as it is iterated: it connects with
:class:`~skippyd.control.client.AsyncControlClient`, subscribes to periodic snapshots
and telemetry events, and turns every pushed message into a typed item
(:class:`Connected`, :class:`SnapshotReceived`, :class:`EventReceived`,
:class:`Dropped`, :class:`ServerError`). When the daemon goes away it yields
:class:`Disconnected` with the delay before the next attempt and reconnects by itself
with exponential backoff (:class:`Backoff`, 0.5 s doubling to 5 s).

The message shapes are those of ``docs/control-protocol.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippyd.control.client import AsyncControlClient, ControlConnectError, ControlError
from skippyd.control.protocol import MAX_INTERVAL_MS, MIN_INTERVAL_MS

logger = logging.getLogger(__name__)

#: Default snapshot period requested by ``skippyd top``.
DEFAULT_INTERVAL_MS = 500
#: Default time allowed to connect and receive the hello.
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Connected:
    """The daemon accepted the connection and said hello."""

    stage: str
    """Stage id from the hello."""
    server: str
    """Server identification, e.g. ``skippyd 0.1.0``."""


@dataclass(frozen=True, slots=True)
class SnapshotReceived:
    """One status snapshot (the raw ``snapshot`` object)."""

    snapshot: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EventReceived:
    """One telemetry event."""

    name: str
    """Dotted event name, e.g. ``request.finished``."""
    ts: float
    """Unix time of the event, in seconds."""
    attributes: Mapping[str, Any]
    level: str = "summary"
    """``summary`` (what an operator looks for) or ``debug`` (one per step)."""


@dataclass(frozen=True, slots=True)
class Dropped:
    """The daemon dropped ``count`` items because this client fell behind."""

    count: int


@dataclass(frozen=True, slots=True)
class ServerError:
    """An ``error`` reply; the connection stays open."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The connection failed or ended; the feed retries after ``retry_in_s``."""

    reason: str
    retry_in_s: float


FeedItem = Connected | SnapshotReceived | EventReceived | Dropped | ServerError | Disconnected


class Backoff:
    """Exponential reconnect delays: ``initial_s``, doubled each failure, capped.

    Args:
        initial_s: First delay after a failure.
        max_s: Largest delay.
        factor: Growth per consecutive failure.
    """

    def __init__(self, initial_s: float = 0.5, max_s: float = 5.0, factor: float = 2.0) -> None:
        if not 0 < initial_s <= max_s or factor < 1:
            raise ValueError(f"bad backoff: initial_s={initial_s} max_s={max_s} factor={factor}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self._next_s = initial_s

    def next_delay(self) -> float:
        """The delay to wait now; the following one grows by ``factor``."""
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * self.factor)
        return delay

    def reset(self) -> None:
        """Start over at ``initial_s`` (after a successful connection)."""
        self._next_s = self.initial_s


def to_item(message: Mapping[str, Any]) -> FeedItem | None:
    """Turn one pushed message from the daemon into a feed item.

    Args:
        message: The decoded JSON object.

    Returns:
        The item, or None for messages the dashboard ignores (replies, and unknown
        types, which a newer daemon may add).
    """
    kind = message.get("type")
    if kind == "snapshot" and isinstance(message.get("snapshot"), Mapping):
        return SnapshotReceived(message["snapshot"])
    if kind == "event" and isinstance(message.get("event"), Mapping):
        event = message["event"]
        attributes = event.get("attributes")
        ts = event.get("ts")
        return EventReceived(str(event.get("name", "?")),
                             float(ts) if isinstance(ts, int | float) else 0.0,
                             attributes if isinstance(attributes, Mapping) else {},
                             "debug" if event.get("level") == "debug" else "summary")
    if kind == "dropped":
        count = message.get("count")
        return Dropped(count if isinstance(count, int) else 0)
    if kind == "error":
        raw = message.get("error")
        error: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        return ServerError(str(error.get("code", "?")), str(error.get("message", "")))
    return None


class ControlFeed:
    """Follows one control socket forever, reconnecting with backoff.

    Args:
        path: The daemon's control socket.
        interval_ms: Snapshot period to subscribe with (clamped to the protocol bounds).
        events: Whether to ask for telemetry events too.
        backoff: Reconnect delays; default 0.5 s doubling to 5 s.
        sleep: Awaitable sleep; leave as default unless testing.
        timeout_s: Time allowed to connect and get the hello.
        silence_timeout_s: How long a subscribed connection may stay silent before it
            counts as dead; default ten snapshot periods, at least 5 s.
    """

    def __init__(
        self,
        path: Path,
        *,
        interval_ms: int = DEFAULT_INTERVAL_MS,
        events: bool = True,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        silence_timeout_s: float | None = None,
    ) -> None:
        self.path = path
        self.interval_ms = max(MIN_INTERVAL_MS, min(MAX_INTERVAL_MS, interval_ms))
        self.events = events
        self.backoff = backoff or Backoff()
        self._sleep = sleep
        self._timeout_s = timeout_s
        self.silence_timeout_s = (max(5.0, 10 * self.interval_ms / 1000)
                                  if silence_timeout_s is None else silence_timeout_s)

    async def follow(self) -> AsyncIterator[FeedItem]:
        """Yield items from the daemon forever; cancel the consuming task to stop.

        Yields:
            Items in arrival order; a :class:`Disconnected` after every failed attempt
            or lost connection, then the feed sleeps and tries again.
        """
        while True:
            try:
                async for item in self._session():
                    yield item
                reason = "daemon closed the connection"
            except ControlError as exc:
                reason = str(exc)
            delay = self.backoff.next_delay()
            logger.debug("control socket %s: %s; retrying in %.1f s", self.path, reason, delay)
            yield Disconnected(reason, delay)
            await self._sleep(delay)

    async def _session(self) -> AsyncIterator[FeedItem]:
        """One connection: hello, subscribe, then items until it ends."""
        client = await AsyncControlClient.connect(self.path, self._timeout_s)
        self.backoff.reset()
        messages: AsyncGenerator[dict[str, Any], None] | None = None
        try:
            yield Connected(client.stage, str(client.hello.get("server", "?")))
            messages = await client.subscribe(self.interval_ms, events=self.events)
            while True:
                try:
                    async with asyncio.timeout(self.silence_timeout_s):
                        message = await anext(messages, None)
                except TimeoutError:
                    raise ControlConnectError(
                        f"daemon silent for {self.silence_timeout_s:.1f} s") from None
                if message is None:
                    return
                item = to_item(message)
                if item is not None:
                    yield item
        finally:
            if messages is not None:
                await messages.aclose()
            await client.close()
