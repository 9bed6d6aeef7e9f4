"""Fixtures for the worker tests."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_runtime import FakeRuntime

from skippyd.engine.worker.handle import WorkerHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.thread_loop import WorkerLoop

WAIT_S = 5.0


@pytest.fixture(params=["fake"])
def runtime_factory(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Builds the runtime a scheduling test drives (scripted fake by default)."""
    if request.param == "fake":
        return FakeRuntime
    raise ValueError(request.param)


@pytest.fixture
def make_handle() -> Iterator[Callable[..., WorkerHandle]]:
    """Build worker handles that are closed (and their threads joined) after the test.

    Keyword arguments go to :meth:`WorkerSettings.derive` (``queue_capacity`` defaults to
    8), except ``telemetry``.
    """
    created: list[WorkerHandle] = []

    def build(runtime: Any, telemetry: TelemetryHub | None = None,
              **facts: Any) -> WorkerHandle:
        facts.setdefault("queue_capacity", 8)
        worker = WorkerHandle(runtime, WorkerSettings.derive(runtime, **facts),
                              telemetry=telemetry)
        created.append(worker)
        return worker

    yield build
    for worker in created:
        worker.close()
        assert not worker.thread.is_alive()


@pytest.fixture
def make_worker() -> Callable[..., WorkerLoop]:
    """Build a worker core without its thread, to drive turn by turn (like the original)."""

    def build(runtime: Any, queue_capacity: int = 8, **facts: Any) -> WorkerLoop:
        settings = WorkerSettings.derive(runtime, queue_capacity=queue_capacity, **facts)
        commands: queue.Queue[Any] = queue.Queue(maxsize=settings.command_queue_capacity)
        return WorkerLoop(runtime, settings, commands, TelemetryHub())

    return build


@pytest.fixture
def blocked_worker() -> Callable[[WorkerHandle], tuple[threading.Event, threading.Event]]:
    """Park a handle's worker inside a runtime operation until released.

    Returns ``(entered, release)``; the test must set ``release``.
    """

    def park(worker: WorkerHandle) -> tuple[threading.Event, threading.Event]:
        entered, release = threading.Event(), threading.Event()

        def hold(_runtime: Any) -> None:
            entered.set()
            assert release.wait(WAIT_S)

        worker.execute_runtime_detached("test-block", hold)
        assert entered.wait(WAIT_S)
        return entered, release

    return park
