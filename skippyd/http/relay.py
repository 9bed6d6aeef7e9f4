"""Worker-thread events into the event loop, one wake-up per burst.

The worker finishes an iteration by emitting one event per sampled token, for every
stream in the batch, within microseconds. Scheduling each with ``call_soon_threadsafe``
writes the loop's self-pipe and wakes the loop once per token; :class:`EventRelay`
queues them and wakes the loop once, then runs them all in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventRelay] = (
    weakref.WeakKeyDictionary())
_relays_lock = threading.Lock()


class EventRelay:
    """Runs callbacks posted from any thread on one event loop, in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, callback: Callable[[Any], None], argument: Any) -> None:
        """Queue ``callback(argument)`` for the loop thread; callable from any thread.

        Raises:
            RuntimeError: The loop is closed (the callback will never run).
        """
        with self._lock:
            self._pending.append((callback, argument))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._run_pending)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
                self._pending.clear()
            raise

    def _run_pending(self) -> None:
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
            self._scheduled = False
        for callback, argument in batch:
            try:
                callback(argument)
            except Exception:  # one consumer's bug must not starve the others
                logger.exception("event callback failed")


def relay_for(loop: asyncio.AbstractEventLoop) -> EventRelay:
    """The relay of ``loop`` (one per loop, created on first use)."""
    with _relays_lock:
        relay = _relays.get(loop)
        if relay is None:
            relay = _relays[loop] = EventRelay(loop)
        return relay
