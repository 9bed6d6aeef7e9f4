"""Fixtures for the iteration scheduler worker tests."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_runtime import FakeRuntime

from skippyd.engine.worker.handle import IterationScheduler
from skippyd.engine.worker.settings import build_scheduler_config, make_worker_settings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.thread_loop import SchedulerWorker

WAIT_S = 5.0


@pytest.fixture(params=["fake"])
def runtime_factory(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Builds the runtime a scheduling test drives (scripted fake by default)."""
    if request.param == "fake":
        return FakeRuntime
    raise ValueError(request.param)


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., IterationScheduler]]:
    """Build schedulers that are closed (and their workers joined) after the test."""
    created: list[IterationScheduler] = []

    def build(runtime: Any, **kwargs: Any) -> IterationScheduler:
        kwargs.setdefault("queue_capacity", 8)
        scheduler = IterationScheduler(runtime, **kwargs)
        created.append(scheduler)
        return scheduler

    yield build
    for scheduler in created:
        scheduler.close()
        assert not scheduler.thread.is_alive()


@pytest.fixture
def make_worker() -> Callable[..., SchedulerWorker]:
    """Build a worker core without its thread, to drive turn by turn (like the original)."""

    def build(runtime: Any, queue_capacity: int = 8, **config: Any) -> SchedulerWorker:
        lanes = runtime.lane_count
        scheduler_config = build_scheduler_config(
            lanes, runtime.kv_pool_tokens, config.pop("recurrent_bytes_per_seq", 0),
            config.pop("n_batch", None), config.pop("n_ubatch", None), queue_capacity,
        )
        settings = make_worker_settings(lanes, queue_capacity, None, 1, scheduler_config)
        commands: queue.Queue[Any] = queue.Queue(maxsize=settings.command_queue_capacity)
        return SchedulerWorker(runtime, scheduler_config, commands, TelemetryHub(), settings)

    return build


@pytest.fixture
def blocked_worker() -> Callable[[IterationScheduler], tuple[threading.Event, threading.Event]]:
    """Park a scheduler's worker inside a runtime operation until released.

    Returns ``(entered, release)``; the test must set ``release``.
    """

    def park(scheduler: IterationScheduler) -> tuple[threading.Event, threading.Event]:
        entered, release = threading.Event(), threading.Event()

        def hold(_runtime: Any) -> None:
            entered.set()
            assert release.wait(WAIT_S)

        scheduler.execute_runtime_detached("test-block", hold)
        assert entered.wait(WAIT_S)
        return entered, release

    return park
