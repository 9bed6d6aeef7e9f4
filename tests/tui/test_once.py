"""``skippyd top --once`` is ``skippyd status``: one resolver, one renderer, one exit table."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from scripted_server import ScriptedServer, make_link, make_snapshot

from skippyd.exitcodes import ExitCode
from skippyd.tui import run_top
from skippyd.tui.status import render_status, run_status

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


async def status(path: Path, as_json: bool) -> tuple[int, str, str]:
    """run_status in a thread (it blocks), the server on this loop."""
    out, err = consoles()
    code = await asyncio.to_thread(run_status, path, None, as_json, out=out, err=err,
                                   timeout_s=2.0)
    return code, output(out), output(err)


async def test_json_prints_the_raw_snapshot(server: ScriptedServer) -> None:
    server.snapshot = make_snapshot()
    code, out, err = await status(server.path, as_json=True)
    assert (code, err) == (ExitCode.OK, "")
    assert json.loads(out) == server.snapshot
    assert server.requests == [{"v": 1, "id": 1, "op": "status"}]


async def test_a_stage_that_is_not_serving_renders_and_exits_1(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    code, out, _ = await status(server.path, as_json=False)
    assert code == ExitCode.FAILURE == 1
    for text in ("stage stage-3", "#0 layers 0:4", "tiny-model", "failed (worker died)",
                 "waiting 5", "100/400 (25.0%)", "req-a", "decode", "1 busy of 2"):
        assert text in out, text
    ttft = next(line for line in out.splitlines() if "time to first token" in line)
    assert ttft.replace("│", " ").split()[-4:] == ["12.5", "40.0", "-", "3"]


async def test_without_a_daemon_it_fails_clearly(socket_path: Path) -> None:
    code, out, err = await status(socket_path, as_json=True)
    assert code == ExitCode.UNREACHABLE and out == ""
    assert "error:" in err and "cannot connect" in err


def test_the_link_of_a_split_stage_is_shown_only_there() -> None:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render_status(make_snapshot(link=make_link(connections=2, bytes_in=4096))))
    assert "link          connections 2 (1 open) · rejected 0 · active sessions 0" in output(console)
    assert "link traffic  received 4.0 KiB · sent 0 B" in output(console)
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(render_status(SNAPSHOT))
    assert "link" not in output(console)


def test_render_tolerates_missing_sections() -> None:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render_status({"uptime_s": 5, "lanes": [{"phase": "decode"}], "link": 3}))
    text = output(console)
    assert "stage ?" in text and "waiting 0" in text and "1 busy of 1" in text


async def test_top_once_reads_the_config_socket(server: ScriptedServer, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    server.snapshot = SNAPSHOT
    config = tmp_path / "stage.toml"
    config.write_text(f'[stage]\nid = "stage-3"\n[control]\nsocket = "{server.path}"\n')
    code = await asyncio.to_thread(run_top, None, config, True, True)
    assert code == ExitCode.FAILURE  # the snapshot says "failed", as status would
    assert json.loads(capsys.readouterr().out) == SNAPSHOT


@pytest.mark.parametrize("once", [True, False])
def test_a_bad_config_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        once: bool) -> None:
    config = tmp_path / "stage.toml"
    config.write_text("[runtime]\nlane_count = -1\n")
    assert run_top(None, config, once, False) == ExitCode.CONFIG == 4
    assert "runtime.lane_count" in capsys.readouterr().err
