"""A runtime wrapper that makes a hung llama.cpp call visible.

The worker thread cannot report on itself while it is stuck inside ``llama_decode``, so
the wrapper records when the current call started; ``/health`` and the systemd watchdog
read :meth:`WatchedRuntime.busy_for` from other threads.

Fault injection for tests: ``SKIPPYD_FAULT=hang-iteration`` makes every batched
iteration block forever (the only way to produce a hung native call on demand).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from skippyd.engine.runtime.protocol import (
    IterationOutput,
    IterationRequest,
    Runtime,
    RuntimeWrapper,
)

logger = logging.getLogger(__name__)

FAULT_ENV = "SKIPPYD_FAULT"


class WatchedRuntime(RuntimeWrapper):
    """A :class:`Runtime` that timestamps the batched iterations of ``inner``.

    Args:
        inner: The runtime the worker drives.
        fault: ``hang-iteration`` blocks every iteration forever (tests only); None
            reads ``SKIPPYD_FAULT``.
    """

    def __init__(self, inner: Runtime, *, fault: str | None = None) -> None:
        super().__init__(inner)
        self._started: float | None = None
        self._fault = fault if fault is not None else os.environ.get(FAULT_ENV)
        if self._fault:
            logger.warning("fault injection active: %s", self._fault)

    def busy_for(self) -> float:
        """Seconds the current runtime call has been running (0 when idle)."""
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    def iteration_batch_sampled(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        self._started = time.monotonic()
        try:
            if self._fault == "hang-iteration":
                threading.Event().wait()
            return self.inner.iteration_batch_sampled(requests)
        finally:
            self._started = None
