"""The dashboard against the daemon's real control server (no model: a scripted snapshot)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pilot_helpers import header_text, make_app, queue_shows, wait_for
from rich.console import Console
from scripted_server import make_snapshot

from skippyd.control.server import ControlServer
from skippyd.engine.telemetry_events import RequestPreempted
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.tui.status import run_status
from skippyd.tui.tables import EventLog, LatencyTable


class Stage:
    """A real ControlServer whose snapshot the test sets."""

    def __init__(self, path: Path) -> None:
        self.snapshot: dict[str, Any] = make_snapshot(
            stage={"id": "stage-r"}, queues={"waiting": 2},
            latency_ms={"ttft": {"p50": 5.0, "p95": 6.0, "p99": 7.0, "count": 4}})
        self.hub = TelemetryHub()
        self.path = path
        self.server = self._make_server()

    def _make_server(self) -> ControlServer:
        return ControlServer(self.path, stage_id="stage-r", snapshot=lambda: self.snapshot,
                             telemetry=self.hub)

    async def restart(self) -> None:
        self.server = self._make_server()
        await self.server.start()


@pytest.fixture
async def stage(socket_path: Path) -> AsyncIterator[Stage]:
    real = Stage(socket_path)
    await real.server.start()
    try:
        yield real
    finally:
        await real.server.close()


async def test_dashboard_follows_the_real_control_server(stage: Stage) -> None:
    app = make_app(stage.path)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 2), "first snapshot")
        assert "stage-r" in header_text(app)
        assert app.query_one(LatencyTable).get_row("ttft") == ["ttft", "5.0", "6.0", "7.0", "4"]
        stage.hub.publish(RequestPreempted("r-9", 3))
        log = app.query_one(EventLog)
        await wait_for(pilot, lambda: any("request.preempted request_id=r-9" in line
                                          for line in log.shown), "a hub event in the log")
        await stage.server.close()
        await wait_for(pilot, lambda: "disconnected" in header_text(app), "disconnected shown")
        stage.snapshot = make_snapshot(stage={"id": "stage-r"}, queues={"waiting": 5})
        await stage.restart()
        await wait_for(pilot, lambda: queue_shows(app, 5), "data after the restart")


async def test_once_against_the_real_control_server(stage: Stage) -> None:
    out = Console(file=io.StringIO(), color_system=None)
    code = await asyncio.to_thread(run_status, stage.path, None, True, out=out)
    assert code == 0
    assert json.loads(out.file.getvalue()) == stage.snapshot
