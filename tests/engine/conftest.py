"""Engine fixtures on the tiny model: runtimes, worker stacks with or without a prefix cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cache_helpers import SETTINGS, open_runtime

from skippyd.engine.prefix_cache import LivePrefixCache, PrefixCacheSettings
from skippyd.engine.runtime.llama import LlamaRuntime
from skippyd.engine.worker.handle import GenerationHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub


@pytest.fixture
def runtime(tiny_model_path) -> Iterator[LlamaRuntime]:
    with open_runtime(tiny_model_path) as rt:
        yield rt


@pytest.fixture
def make_stack(tiny_model_path) -> Iterator[Callable[..., tuple[GenerationHandle, Any]]]:
    """Build (worker, cache or None) over a fresh tiny runtime; closed after the test."""
    opened: list[tuple[GenerationHandle, LlamaRuntime]] = []

    def build(*, cache: bool = True, settings: PrefixCacheSettings = SETTINGS, lanes: int = 4,
              ctx_size: int = 2048, queue_capacity: int = 8):
        runtime = open_runtime(tiny_model_path, lanes=lanes, ctx_size=ctx_size)
        hub = TelemetryHub()
        live = LivePrefixCache(runtime, settings, namespace="tiny:0-4",
                               publish=hub.publish) if cache else None
        settings = WorkerSettings.derive(runtime, queue_capacity=queue_capacity)
        worker = GenerationHandle(runtime, settings, telemetry=hub, prefix_cache=live)
        opened.append((worker, runtime))
        return worker, live

    yield build
    for worker, runtime in opened:
        worker.close()
        assert not worker.thread.is_alive()
        runtime.close()
