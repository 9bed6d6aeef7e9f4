"""Worker-thread events into the event loop, one wake-up per burst.

The worker finishes an iteration by emitting one event per sampled token, for every
stream in the batch, within microseconds. Scheduling each with ``call_soon_threadsafe``
writes the loop's self-pipe and wakes the loop once per token; :class:`EventRelay`
queues them and wakes the loop once, then runs them all in order.

For the worker thread the relay can hold even that wake-up back until the worker is
about to wait (:meth:`EventRelay.defer_wakes_from`, flushed from the worker's wait
hooks): the loop then runs while llama.cpp computes, instead of taking the GIL from the
worker between two model calls. The events are the same, a fraction of a millisecond
later. Where the platform has eventfds, that wake-up is the relay's own eventfd, which the
worker signals from native code once it has released the GIL for the model call
(:meth:`EventRelay.owed_wake`): the loop thread then finds the GIL free instead of
waking, sleeping on the GIL and waking again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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
        self._deferring: threading.Thread | None = None
        self._wake_owed = False
        self._wake_fd: int | None = None

    def defer_wakes_from(self, thread: threading.Thread | None) -> None:
        """Let posts made on ``thread`` wake the loop only at the next :meth:`flush`.

        The owner of ``thread`` must call :meth:`flush` (or :meth:`owed_wake`) before
        ``thread`` waits for anything, or its posts sit unseen. None makes every post
        wake the loop again. Call on the loop's thread.
        """
        with self._lock:
            self._deferring = thread
        if thread is not None and self._wake_fd is None and hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            # NOTE: never closed before the relay goes: the deferring thread may still
            # hold the number, and a write to a reused descriptor would hit another file.
            weakref.finalize(self, os.close, fd)
            self._loop.add_reader(fd, self._on_wake_fd)
            self._wake_fd = fd
        self.flush()

    def post(self, callback: Callable[[Any], None], argument: Any) -> None:
        """Queue ``callback(argument)`` for the loop thread; callable from any thread.

        Raises:
            RuntimeError: The loop is closed (the callback will never run).
        """
        with self._lock:
            self._pending.append((callback, argument))
            if self._scheduled:
                return
            if self._deferring is not None and threading.current_thread() is self._deferring:
                if self._loop.is_closed():
                    self._pending.pop()
                    raise RuntimeError("the event loop is closed")
                self._wake_owed = True
                return
            self._scheduled = True
        self._wake()

    def flush(self) -> None:
        """Wake the loop for posts held back by :meth:`defer_wakes_from`, if any."""
        if not self._claim_owed_wake():
            return
        try:
            self._wake()
        except RuntimeError:  # closed between the post and now: nobody reads them
            logger.debug("event loop closed: the events held for it were dropped")

    def owed_wake(self) -> int | None:
        """The deferring thread's wait hook: claim the wake-up its posts are owed.

        Returns the relay's eventfd, which the caller must signal (the loop runs the held
        events once it is), or None: nothing is owed, a wake-up is already on its way,
        or the relay has no eventfd and has just woken the loop itself.
        """
        if self._wake_fd is None:
            self.flush()
            return None
        return self._wake_fd if self._claim_owed_wake() else None

    def _claim_owed_wake(self) -> bool:
        """True when held posts are owed a wake-up and none is on its way; the caller
        then sends it."""
        with self._lock:
            owed, self._wake_owed = self._wake_owed, False
            if not owed or self._scheduled:
                return False
            self._scheduled = True
            return True

    def _on_wake_fd(self) -> None:
        assert self._wake_fd is not None
        with contextlib.suppress(BlockingIOError):  # already read by an earlier turn
            os.eventfd_read(self._wake_fd)
        self._run_pending()

    def _wake(self) -> None:
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
            self._wake_owed = False
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
