"""Requests on their way to the worker: a burst the first step may wait for.

When clients arrive together at an idle stage (eight streams restarting at once), the
worker should take them in one step: prefilled together they finish together, decode in
step and restart together again, and no stream's decoding is ever stalled by another's
prompt. Taken one by one, the first prompt starts alone, the others are chunked beside
its decode rows, and the streams drift apart for good. The API layer counts the requests
it has begun to handle and not yet submitted (:meth:`Arrivals.arriving`); a worker that
wakes from idle waits a moment for them (``GenerationWorker``'s burst wait).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Arrivals:
    """How many requests the API layer is preparing right now (any thread)."""

    def __init__(self) -> None:
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Requests received and not yet submitted (or refused)."""
        return self._pending

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Count one request while it is read, parsed and tokenized."""
        with self._lock:
            self._pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1
