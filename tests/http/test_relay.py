"""The event relay: callbacks from other threads run on the loop, in order, batched."""

from __future__ import annotations

import asyncio
import threading

from skippyd.http.relay import EventRelay, relay_for


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
