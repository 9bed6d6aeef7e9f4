"""The ``telemetry.metrics_listen`` listener: ``/metrics`` and ``/health``, nothing else.

A later stage of a split pipeline has no HTTP API; this is how Prometheus scrapes it
(and how a load balancer or a probe asks for its health). On stage 0 it gives a scrape
port apart from the API, without the API key. It runs in the daemon's event loop
beside everything else and opens before the model loads, so ``/health`` answers 503
``loading`` during start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from skippyd.daemon.assembly import StageEngine, StartupError
from skippyd.http.observability.metrics import ServingMetrics
from skippyd.http.observability.prometheus import metrics_app

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves the process's signals to the daemon."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class MetricsListener:
    """Serves ``metrics`` and the engine's health on ``address``.

    Args:
        engine: Whose health ``/health`` reports.
        metrics: Whose registry ``/metrics`` serves.
        address: ``(host, port)``; port 0 picks a free port.
    """

    def __init__(self, engine: StageEngine, metrics: ServingMetrics,
                 address: tuple[str, int]) -> None:
        self._address = address
        app = metrics_app(metrics, engine.health)
        self._server = _Server(uvicorn.Config(app, log_config=None, access_log=False,
                                              lifespan="off", timeout_graceful_shutdown=1))
        self._task: asyncio.Task[Any] | None = None
        self.bound: tuple[str, int] | None = None

    async def start(self) -> None:
        """Bind and serve.

        Raises:
            StartupError: The address cannot be bound.
        """
        host, port = self._address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise StartupError(f"telemetry.metrics_listen: cannot listen on {host}:{port}:"
                               f" {exc.strerror or exc}") from exc
        self.bound = (host, sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        logger.info("metrics on http://%s:%d/metrics", *self.bound)

    async def close(self) -> None:
        """Stop serving; idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        self._server.should_exit = True
        await task


async def open_metrics_listener(engine: StageEngine,
                                metrics: ServingMetrics) -> MetricsListener | None:
    """Start the listener when the config asks for one (None otherwise).

    Raises:
        StartupError: The address cannot be bound.
    """
    address = engine.config.telemetry.metrics_address
    if address is None:
        return None
    listener = MetricsListener(engine, metrics, address)
    await listener.start()
    return listener
