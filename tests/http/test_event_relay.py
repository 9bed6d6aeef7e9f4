"""The event relay: callbacks from other threads run on the loop, in order, batched."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest

from skippyd.http.event_relay import EventRelay, relay_for


async def held_until_released(delivered: asyncio.Event, received: list,
                              release: threading.Event) -> None:
    """The loop is free to run (this coroutine awaits) and still nothing arrives; once
    ``release`` is set the event is delivered."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(delivered.wait(), 0.2)
    assert received == []
    release.set()
    await asyncio.wait_for(delivered.wait(), 10)


async def test_a_burst_from_another_thread_wakes_the_loop_once_and_keeps_order() -> None:
    loop = asyncio.get_running_loop()
    relay = EventRelay(loop)
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(callback, *args):
        nonlocal wakeups
        wakeups += 1
        return original(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    received: list[int] = []
    done = asyncio.Event()

    def on_value(value: int) -> None:
        received.append(value)
        if value == 99:
            done.set()

    def burst() -> None:
        for value in range(100):
            relay.post(on_value, value)

    try:
        thread = threading.Thread(target=burst)
        thread.start()  # the loop cannot run until this coroutine awaits
        thread.join()
        await asyncio.wait_for(done.wait(), 10)
    finally:
        del loop.call_soon_threadsafe
    assert received == list(range(100))
    assert wakeups == 1


async def test_a_failing_callback_does_not_stop_the_others() -> None:
    relay = EventRelay(asyncio.get_running_loop())
    received: list[str] = []
    done = asyncio.Event()

    def fail(_: str) -> None:
        raise ValueError("consumer bug")

    def record(value: str) -> None:
        received.append(value)
        done.set()

    await asyncio.to_thread(lambda: (relay.post(fail, "a"), relay.post(record, "b")))
    await asyncio.wait_for(done.wait(), 10)
    assert received == ["b"]


async def test_one_relay_per_loop() -> None:
    loop = asyncio.get_running_loop()
    assert relay_for(loop) is relay_for(loop)


async def test_posts_of_the_deferring_thread_wait_for_its_flush() -> None:
    loop = asyncio.get_running_loop()
    relay = EventRelay(loop)
    received: list[str] = []
    delivered = asyncio.Event()
    posted, flush_now = threading.Event(), threading.Event()

    def record(value: str) -> None:
        received.append(value)
        delivered.set()

    def worker() -> None:
        relay.post(record, "token")
        posted.set()
        flush_now.wait(10)
        relay.flush()

    thread = threading.Thread(target=worker)
    relay.defer_wakes_from(thread)
    thread.start()
    assert await asyncio.to_thread(posted.wait, 10)
    await held_until_released(delivered, received, flush_now)
    thread.join()
    assert received == ["token"]


async def test_other_threads_still_wake_the_loop_and_carry_held_events_along() -> None:
    loop = asyncio.get_running_loop()
    relay = EventRelay(loop)
    received: list[str] = []
    done = asyncio.Event()

    def record(value: str) -> None:
        received.append(value)
        if value == "other":
            done.set()

    relay.defer_wakes_from(threading.current_thread())
    relay.post(record, "held")  # this thread defers: no wake-up yet
    await asyncio.to_thread(relay.post, record, "other")
    await asyncio.wait_for(done.wait(), 10)
    assert received == ["held", "other"]
    relay.flush()  # nothing owed any more: a no-op


async def test_ending_the_deferral_releases_what_was_held() -> None:
    relay = EventRelay(asyncio.get_running_loop())
    done = asyncio.Event()
    relay.defer_wakes_from(threading.current_thread())
    relay.post(lambda _: done.set(), None)
    relay.defer_wakes_from(None)
    await asyncio.wait_for(done.wait(), 10)


async def test_a_deferred_post_to_a_closed_loop_raises_at_once() -> None:
    other = asyncio.new_event_loop()
    relay = EventRelay(other)
    relay.defer_wakes_from(threading.current_thread())
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        relay.post(lambda _: None, None)
    relay.flush()  # nothing held, nothing raised


async def test_the_owed_wake_is_an_eventfd_the_worker_signals() -> None:
    relay = EventRelay(asyncio.get_running_loop())
    delivered = asyncio.Event()
    received: list[str] = []
    claimed: list[int | None] = []
    signal_now = threading.Event()

    def record(value: str) -> None:
        received.append(value)
        delivered.set()

    def worker() -> None:
        claimed.append(relay.owed_wake())  # nothing posted: nothing owed
        relay.post(record, "token")
        claimed.append(relay.owed_wake())
        claimed.append(relay.owed_wake())  # already claimed
        signal_now.wait(10)
        os.eventfd_write(claimed[1], 1)

    thread = threading.Thread(target=worker)
    relay.defer_wakes_from(thread)
    thread.start()
    # Claimed, not yet signalled: nothing runs.
    await held_until_released(delivered, received, signal_now)
    thread.join()
    assert received == ["token"]
    assert claimed[0] is None and isinstance(claimed[1], int) and claimed[2] is None
