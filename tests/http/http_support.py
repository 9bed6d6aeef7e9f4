"""Helpers shared by the HTTP tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

WAIT_S = 10.0


async def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Let the event loop run (its callbacks, timers and servers) until ``predicate``
    holds; fails with a timeout after ``timeout_s``."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)
