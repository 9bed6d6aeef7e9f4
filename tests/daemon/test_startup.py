"""Start-up keeps systemd's timeout open while the load advances, and only then."""

from __future__ import annotations

import asyncio
import threading

import pytest

from skippyd.daemon.startup import StartupProgress, load_with_progress


class Notifier:
    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.sent = threading.Event()

    def notify(self, **fields) -> bool:
        self.messages.append(fields)
        self.sent.set()
        return True

    def next(self) -> dict:
        assert self.sent.wait(10), "no start-up notification"
        self.sent.clear()
        return self.messages[-1]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_extensions_follow_progress_and_stop_when_it_stops():
    clock, notifier = Clock(), Notifier()
    progress = StartupProgress(clock)
    go_on, finish = threading.Event(), threading.Event()

    def load() -> str:
        progress.step("slicing layers 0:15")
        progress.advance(0.25)
        assert go_on.wait(10)
        progress.step("loading the model")
        assert finish.wait(10)
        return "loaded"

    async def drive() -> None:
        first = await asyncio.to_thread(notifier.next)
        while "EXTEND_TIMEOUT_USEC" not in first:  # the step's own STATUS came first
            first = await asyncio.to_thread(notifier.next)
        assert first == {"EXTEND_TIMEOUT_USEC": 60_000_000,
                         "STATUS": "loading: slicing layers 0:15 (25%)"}
        clock.now += 61.0  # nothing advanced for longer than the window
        stalled = await asyncio.to_thread(notifier.next)
        while "EXTEND_TIMEOUT_USEC" in stalled:
            stalled = await asyncio.to_thread(notifier.next)
        assert stalled == {"STATUS": "loading: slicing layers 0:15 (25%), not advancing"}
        go_on.set()  # the next step starts: progress again
        resumed = await asyncio.to_thread(notifier.next)
        while (resumed.get("STATUS") != "loading: loading the model"
               or "EXTEND_TIMEOUT_USEC" not in resumed):
            resumed = await asyncio.to_thread(notifier.next)
        assert resumed["EXTEND_TIMEOUT_USEC"] == 60_000_000
        finish.set()

    driver = asyncio.create_task(drive())
    result = await load_with_progress(load, progress, notifier, interval_s=0.01, window_s=60.0)
    await driver
    assert result == "loaded"


async def test_each_step_is_announced_as_it_begins_even_in_a_load_shorter_than_a_tick():
    notifier, progress = Notifier(), StartupProgress()

    def load() -> str:
        progress.step("reading the model header")
        progress.step("loading the model")
        return "loaded"

    assert await load_with_progress(load, progress, notifier, interval_s=60.0) == "loaded"
    assert notifier.messages == [{"STATUS": "loading: reading the model header"},
                                 {"STATUS": "loading: loading the model"}]
    progress.step("after the load")  # nobody is told any more
    assert len(notifier.messages) == 2


async def test_a_failed_load_raises_its_error():
    def load() -> None:
        raise ValueError("not a GGUF")

    with pytest.raises(ValueError, match="not a GGUF"):
        await load_with_progress(load, StartupProgress(), Notifier(), interval_s=0.01)


def test_status_lines():
    clock = Clock()
    progress = StartupProgress(clock)
    progress.step("loading the model")
    assert progress.status() == "loading: loading the model"
    clock.now += 5
    progress.advance(0.5)
    assert progress.status() == "loading: loading the model (50%)"
    assert progress.idle_for() == 0.0
    clock.now += 3
    progress.advance(0.5)  # no change is no progress
    assert progress.idle_for() == 3.0
