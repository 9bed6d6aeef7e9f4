"""Start-up that tells systemd it is alive: progress while a big model is sliced and loaded.

A unit's ``TimeoutStartSec=`` must fit a small model on a fast disk and a large one on a
slow disk. The engine's load reports every step (slicing the stage's layers, llama.cpp
loading its tensors, creating the context...) to a :class:`StartupProgress`; while the
load runs, :func:`load_with_progress` sends ``EXTEND_TIMEOUT_USEC`` with a ``STATUS``
line every few seconds, as long as something advanced within the extension window. A
load that stops advancing stops extending, and systemd's timeout applies again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: How often the start-up status is sent while the model loads.
EXTEND_INTERVAL_S = 5.0
#: Each extension asks systemd for this much more time; progress must come within it.
EXTEND_WINDOW_S = 60.0


class StartupProgress:
    """The current load step and when anything last advanced (thread-safe).

    Args:
        clock: Monotonic clock, injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._step = "starting"
        self._fraction: float | None = None
        self._advanced_at = clock()
        self._on_step: Callable[[str], None] | None = None

    def on_step(self, listener: Callable[[str], None] | None) -> None:
        """Call ``listener(status)`` as each later step begins, on the loading thread
        (quick, never blocking); None stops the calls."""
        with self._lock:
            self._on_step = listener

    def step(self, name: str) -> None:
        """A new step begins (counts as progress)."""
        with self._lock:
            self._step, self._fraction, self._advanced_at = name, None, self._clock()
            listener = self._on_step
        if listener is not None:
            listener(self.status())

    def advance(self, fraction: float) -> None:
        """The current step moved on to ``fraction`` (0..1) of its work."""
        with self._lock:
            if fraction != self._fraction:
                self._fraction, self._advanced_at = fraction, self._clock()

    def status(self) -> str:
        """``loading: <step> (45%)`` for systemd's STATUS line."""
        with self._lock:
            step, fraction = self._step, self._fraction
        return f"loading: {step}" + ("" if fraction is None else f" ({fraction:.0%})")

    def idle_for(self) -> float:
        """Seconds since anything advanced."""
        with self._lock:
            return self._clock() - self._advanced_at


async def load_with_progress(load: Callable[[], Any], progress: StartupProgress,
                             notifier: Any, *, interval_s: float = EXTEND_INTERVAL_S,
                             window_s: float = EXTEND_WINDOW_S) -> Any:
    """Run the blocking ``load`` in a thread; meanwhile keep systemd's start timeout open.

    Returns:
        What ``load`` returned.

    Raises:
        Whatever ``load`` raised.
    """
    progress.on_step(lambda status: notifier.notify(STATUS=status))
    try:
        task = asyncio.ensure_future(asyncio.to_thread(load))
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval_s)
            if done:
                return task.result()
            status = progress.status()
            if progress.idle_for() < window_s:
                notifier.notify(EXTEND_TIMEOUT_USEC=int(window_s * 1_000_000), STATUS=status)
            else:
                logger.warning("start-up has not advanced for %.0f s (%s)",
                               progress.idle_for(), status)
                notifier.notify(STATUS=status + ", not advancing")
    finally:
        progress.on_step(None)
