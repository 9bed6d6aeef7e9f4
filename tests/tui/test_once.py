"""``skippyd top --once [--json]`` and ``run_top``'s socket and config handling."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from scripted_server import ScriptedServer, make_link, make_snapshot

from skippyd.tui import EXIT_CONFIG, run_top
from skippyd.tui.once import EXIT_UNREACHABLE, render_snapshot, run_once

SNAPSHOT = make_snapshot(
    stage={"id": "stage-3", "model": "tiny-model", "layer_start": 0, "layer_end": 4},
    queues={"waiting": 5}, kv={"cells_used": 100, "cells_total": 400, "usage": 0.25},
    latency_ms={"ttft": {"p50": 12.5, "p95": 40.0, "p99": None, "count": 3}},
    lanes=[{"lane": 0, "request_id": "req-a", "phase": "decode", "prompt_tokens": 34,
            "generated_tokens": 12}],
    health={"status": "failed", "reason": "worker died"},
)


def consoles() -> tuple[Console, Console]:
    return (Console(file=io.StringIO(), width=120, color_system=None),
            Console(file=io.StringIO(), width=120, color_system=None))


def output(console: Console) -> str:
    return console.file.getvalue()  # type: ignore[attr-defined]


async def once(path: Path, as_json: bool) -> tuple[int, str, str]:
    """run_once in a thread (it runs its own event loop), the server on this loop."""
    out, err = consoles()
    code = await asyncio.to_thread(run_once, path, as_json, out=out, err=err, timeout_s=2.0)
    return code, output(out), output(err)


async def test_once_json_prints_the_raw_snapshot(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    code, out, err = await once(server.path, as_json=True)
    assert (code, err) == (0, "")
    assert json.loads(out) == SNAPSHOT
    assert server.requests == [{"v": 1, "id": 1, "op": "status"}]


async def test_once_renders_a_compact_summary(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    code, out, _ = await once(server.path, as_json=False)
    assert code == 0
    for text in ("stage-3 #0  tiny-model  layers 0-4", "failed (worker died)", "waiting 5",
                 "100/400 cells (25.0%)", "p50 12.5  p95 40.0  p99 -  n 3", "req-a", "decode"):
        assert text in out, text


async def test_once_without_a_daemon_fails_clearly(socket_path: Path) -> None:
    code, out, err = await once(socket_path, as_json=True)
    assert code == EXIT_UNREACHABLE and out == ""
    assert "error:" in err and "cannot connect" in err


def test_render_snapshot_adds_the_link_of_a_split_stage() -> None:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render_snapshot(make_snapshot(link=make_link(connections=2, bytes_in=4096))))
    assert "link          connections 2 (1 open) · rejected 0 · active sessions 0" in output(console)
    assert "received 4.0 KiB · sent 0 B · busy - (0.00 s)" in output(console)
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render_snapshot(SNAPSHOT))
    assert "link" not in output(console)


def test_render_snapshot_tolerates_missing_sections() -> None:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_snapshot({"uptime_s": 5}))
    assert "? #?" in output(console) and "waiting 0" in output(console)


async def test_run_top_once_reads_the_config_socket(server: ScriptedServer, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    server.snapshot = SNAPSHOT
    config = tmp_path / "stage.toml"
    config.write_text(f'[stage]\nid = "stage-3"\n[control]\nsocket = "{server.path}"\n')
    code = await asyncio.to_thread(run_top, None, config, True, True)
    assert code == 0
    assert json.loads(capsys.readouterr().out) == SNAPSHOT


def test_run_top_reports_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "stage.toml"
    config.write_text("[runtime]\nlane_count = -1\n")
    assert run_top(None, config, True, True) == EXIT_CONFIG
    assert "runtime.lane_count" in capsys.readouterr().err
