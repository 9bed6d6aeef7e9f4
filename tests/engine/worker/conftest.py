"""Fixtures for the worker tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_runtime import FakeRuntime

from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.command_loop import CommandLoop
from skippyd.engine.worker.commands import SubmitCommand
from skippyd.engine.worker.drafting import Speculation
from skippyd.engine.worker.faults import FaultSwitch
from skippyd.engine.worker.generations import GenerationWorker
from skippyd.engine.worker.handle import BatchHandle, GenerationHandle, WorkerHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub

WAIT_S = 5.0


@pytest.fixture(params=["fake"])
def runtime_factory(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Builds the runtime a scheduling test drives (scripted fake by default)."""
    if request.param == "fake":
        return FakeRuntime
    raise ValueError(request.param)


def _closing(created: list[WorkerHandle]) -> None:
    for worker in created:
        worker.close()
        assert not worker.thread.is_alive()


@pytest.fixture
def make_handle() -> Iterator[Callable[..., GenerationHandle]]:
    """Build generation workers that are closed (and their threads joined) after the test.

    Keyword arguments go to :meth:`WorkerSettings.derive` (``queue_capacity`` defaults to
    8), except ``telemetry``, ``prefix_cache``, ``faults``, ``arrivals`` and
    ``speculation``.
    """
    created: list[WorkerHandle] = []

    def build(runtime: Any, telemetry: TelemetryHub | None = None, *,
              prefix_cache: LivePrefixCache | None = None, faults: FaultSwitch | None = None,
              arrivals: Arrivals | None = None, speculation: Speculation | None = None,
              **facts: Any) -> GenerationHandle:
        facts.setdefault("queue_capacity", 8)
        worker = GenerationHandle(runtime, WorkerSettings.derive(runtime, **facts),
                                  telemetry=telemetry, prefix_cache=prefix_cache,
                                  faults=faults, arrivals=arrivals, speculation=speculation)
        created.append(worker)
        return worker

    yield build
    _closing(created)


@pytest.fixture
def make_batch_handle() -> Iterator[Callable[..., BatchHandle]]:
    """Build batch workers (a later stage's) that are closed after the test."""
    created: list[WorkerHandle] = []

    def build(runtime: Any, telemetry: TelemetryHub | None = None, *,
              faults: FaultSwitch | None = None, **facts: Any) -> BatchHandle:
        facts.setdefault("queue_capacity", 8)
        worker = BatchHandle(runtime, WorkerSettings.derive(runtime, **facts),
                             telemetry=telemetry, faults=faults)
        created.append(worker)
        return worker

    yield build
    _closing(created)


class TurnDriver:
    """A generation worker without its thread, driven turn by turn from the test.

    Attributes:
        role: The :class:`GenerationWorker` (its ``requests`` and ``scheduler`` are what
            the tests look at).
    """

    def __init__(self, runtime: Any, settings: WorkerSettings,
                 prefix_cache: LivePrefixCache | None) -> None:
        self.loop = CommandLoop(runtime, settings, TelemetryHub())
        self.role = GenerationWorker(self.loop, prefix_cache)
        self.loop.role = self.role

    def submit(self, request: Any, on_event: Callable[[Any], None]) -> None:
        self.role.handle(SubmitCommand(request, on_event))

    def handle(self, command: Any) -> None:
        self.role.handle(command)

    def run_turn(self) -> None:
        self.role.run_turn()

    @property
    def generations(self) -> dict[str, Any]:
        return self.role.generations

    @property
    def scheduler(self) -> Any:
        return self.role.scheduler


@pytest.fixture
def make_worker() -> Callable[..., TurnDriver]:
    """Build a generation worker without its thread, to drive turn by turn."""

    def build(runtime: Any, queue_capacity: int = 8, *,
              prefix_cache: LivePrefixCache | None = None, **facts: Any) -> TurnDriver:
        settings = WorkerSettings.derive(runtime, queue_capacity=queue_capacity, **facts)
        return TurnDriver(runtime, settings, prefix_cache)

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
