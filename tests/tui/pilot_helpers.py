"""Helpers for Pilot tests of the dashboard: a fast app, polling waits, screen text."""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from pathlib import Path

from textual.pilot import Pilot

from skippyd.tui.app import TopApp
from skippyd.tui.source import Backoff, ControlFeed
from skippyd.tui.widgets import QueueDepth, StageHeader

WAIT_S = 5.0


def make_app(path: Path) -> TopApp:
    """The app with a fast feed (100 ms snapshots, short backoff) and a fast repaint."""
    feed = ControlFeed(path, interval_ms=100, backoff=Backoff(0.05, 0.2))
    return TopApp(path, feed=feed, repaint_s=0.05)


async def wait_for(pilot: Pilot, predicate: Callable[[], bool], what: str) -> None:
    """Let the app run until ``predicate`` holds; fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def rendered(widget) -> str:
    """The plain text a render()-based widget shows."""
    result = widget.render()
    return getattr(result, "plain", str(result))


def screen_text(app: TopApp) -> str:
    """The text of an SVG screenshot of the current screen (style runs concatenated)."""
    return html.unescape(app.export_screenshot()).replace("\xa0", " ")


def header_text(app: TopApp) -> str:
    """The header's plain text (both columns)."""
    grid = app.query_one(StageHeader).render()
    return " ".join(cell.plain for column in grid.columns for cell in column.cells)


def queue_shows(app: TopApp, waiting: int) -> bool:
    return app.query_one(QueueDepth).waiting == waiting
