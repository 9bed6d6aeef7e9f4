"""Building the snapshot, finding the socket, and ``skippyd status``'s output and exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from skippyd.config import defaults as config_defaults
from skippyd.config import parse_config
from skippyd.control.client import ControlConnectError, resolve_socket_path
from skippyd.control.server import ControlServer
from skippyd.daemon.snapshot import build_snapshot
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.worker_stats import WorkerStats
from skippyd.exitcodes import ExitCode
from skippyd.http.observability.metrics import ServingMetrics
from skippyd.tui.status import render_status, run_status


@dataclass(frozen=True)
class LaneInfo:
    lane: int
    request_id: str
    phase: str
    prompt_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class StatsWithLanes(WorkerStats):
    """The stats as the worker reports them once it lists its lanes."""

    lanes: tuple[LaneInfo, ...] = ()
    kv_cells_used: int = 0


@dataclass
class FakeWorker:
    current: WorkerStats = field(default_factory=WorkerStats)

    def stats(self) -> WorkerStats:
        return self.current


class FakeEngine:
    def __init__(self, stats: WorkerStats, health: tuple[str, str | None],
                 link: dict | None = None) -> None:
        self.config = parse_config({"stage": {"id": "beta", "layer_start": 0, "layer_end": 12},
                                    "runtime": {"lane_count": 3, "ctx_size": 3072}})
        self.model_id = "some-model"
        self.ctx_size = 1024
        self.offload = {"gpu_layers": 0, "main_gpu": 0, "tensor_split": [],
                        "gpu_backend": False}
        self.worker = FakeWorker(stats)
        self._health = health
        self._link = link

    def health(self) -> tuple[str, str | None]:
        return self._health

    def link_status(self) -> dict | None:
        return self._link


def link_counters(**stage: object) -> dict:
    """A split stage's ``link`` section (docs/control-protocol.md) with ``stage`` merged in."""
    return {"stage_id": "beta", "stage_index": 0, "layer_start": 0, "layer_end": 12,
            "is_final": False, "chains": 0, "bytes_in": 0, "bytes_out": 0, "batches": 0,
            "connections": 0, "rejected": 0, "uptime_s": 80.0, "active_sessions": 0,
            "busy_s": 2.0, **stage}


STAGE0_LINK = link_counters(
    batches_sent=40, lookahead_steps=12, lookahead_hits=9, lookahead_retracted=1,
    chain={"up": True, "reason": None, "epoch": 2, "num_stages": 3, "bytes_out": 3 * 2**20,
           "bytes_in": 1536})
LATER_LINK = link_counters(
    stage_id="gamma", stage_index=1, is_final=True, chains=1, connections=2, rejected=1,
    batches=40, bytes_in=5 * 2**20, bytes_out=2048, active_sessions=2, busy_s=20.0)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sks"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def busy_stats() -> StatsWithLanes:
    return StatsWithLanes(
        num_active=1, num_waiting=2, num_iterations=40, num_preempted=1,
        last_step_ms=3.0, last_overhead_ms=0.5, step_target_ms=500.0, active_runtime_sessions=1,
        max_direct_batch_size=3, kv_cells_used=256,
        lanes=(LaneInfo(1, "chatcmpl-123", "decode", 17, 5),),
    )


def test_snapshot_schema_with_lanes_from_the_worker() -> None:
    engine = FakeEngine(busy_stats(), ("failed", "worker panicked"))
    metrics = ServingMetrics(engine.worker.stats, kv_cells_total=lambda: 3072)
    metrics.record_rejection("queue_full")
    snap = build_snapshot(engine, metrics, time.monotonic() - 5.0)
    assert set(snap) == {"stage", "uptime_s", "health", "lane_count", "lanes", "queues", "wave",
                         "kv", "prefix_cache", "throughput", "latency_ms", "counters",
                         "scheduler", "link", "fast_paths", "speculation"}
    assert snap["link"] is None
    assert set(snap["fast_paths"]) == {"activation_capture", "wake_before_decode",
                                       "greedy_pick"}
    assert snap["stage"] == {"id": "beta", "index": 0, "model": "some-model", "layer_start": 0,
                             "layer_end": 12, "is_first": True, "is_final": True,
                             "offload": engine.offload}
    assert 5.0 <= snap["uptime_s"] < 60.0
    assert snap["health"] == {"status": "failed", "reason": "worker panicked"}
    assert snap["lanes"] == [
        {"lane": 0, "request_id": "", "phase": "idle", "prompt_tokens": 0, "generated_tokens": 0},
        {"lane": 1, "request_id": "chatcmpl-123", "phase": "decode", "prompt_tokens": 17,
         "generated_tokens": 5},
        {"lane": 2, "request_id": "", "phase": "idle", "prompt_tokens": 0, "generated_tokens": 0},
    ]
    assert snap["queues"] == {"waiting": 2, "commands": 0, "direct": 0}
    assert snap["wave"] == {"active_sessions": 1, "batch_size": 3, "fullness": 1 / 3,
                            "full": False}
    assert snap["kv"] == {"cells_used": 256, "cells_total": 3072, "usage": 256 / 3072,
                          "layout": "per_lane", "request_max_tokens": 1024}
    assert snap["counters"]["rejected"] == 1 and snap["counters"]["preempted"] == 1
    assert snap["scheduler"]["last_step_ms"] == 3.0
    assert snap["scheduler"]["step_target_ms"] == 500.0
    for name in ("ttft", "itl", "e2e"):
        assert snap["latency_ms"][name] == {"p50": None, "p95": None, "p99": None, "count": 0}
    json.dumps(snap, allow_nan=False)


def test_snapshot_of_a_stage_still_loading(tiny_model_path: Path) -> None:
    from skippyd.daemon.assembly import StageEngine

    engine = StageEngine(parse_config({"stage": {"model_path": str(tiny_model_path)},
                                       "runtime": {"lane_count": 2}}))
    snap = build_snapshot(engine, ServingMetrics.for_engine(engine), time.monotonic())
    assert snap["health"] == {"status": "loading", "reason": "loading the model"}
    assert [lane["phase"] for lane in snap["lanes"]] == ["idle", "idle"]
    assert snap["counters"]["iterations"] == 0
    assert snap["link"] is None
    console = Console(record=True, width=120)
    console.print(render_status(snap))
    assert "health loading" in console.export_text()


def test_render_shows_busy_lanes_and_health() -> None:
    engine = FakeEngine(busy_stats(), ("failed", "worker panicked"))
    snap = build_snapshot(engine, ServingMetrics(), time.monotonic() - 3725.0)
    console = Console(record=True, width=120)
    console.print(render_status(snap))
    text = console.export_text()
    assert "stage beta" in text and "layers 0:12" in text
    assert "failed (worker panicked)" in text and "up 1h02m" in text
    assert "chatcmpl-123" in text and "decode" in text and "1 busy of 3" in text
    assert "waiting 2" in text
    assert "a stream per lane, up to 1024 tokens a request" in text
    assert "last step 3.00 ms (target 500 ms)" in text
    assert "fast paths" in text and "greedy pick numpy" in text
    assert re.search(r"offload +CPU *\n", text)


@pytest.mark.parametrize(("offload", "shown"), [
    ({"gpu_layers": 0, "gpu_backend": True}, "CPU (a GPU backend is available)"),
    ({"gpu_layers": 20, "gpu_backend": False},
     "CPU: gpu_layers 20 asked, but llama.cpp has no GPU backend"),
    ({"gpu_layers": -1, "main_gpu": 1, "tensor_split": [3.0, 1.0], "gpu_backend": True},
     "GPU: all layers, main GPU 1, split 3,1"),
])
def test_status_says_where_the_layers_run(offload: dict, shown: str) -> None:
    engine = FakeEngine(busy_stats(), ("ok", None))
    engine.offload = offload
    console = Console(record=True, width=160)
    console.print(render_status(build_snapshot(engine, ServingMetrics(), time.monotonic())))
    assert shown in console.export_text()


def test_snapshot_carries_the_link_of_a_split_stage() -> None:
    engine = FakeEngine(WorkerStats(), ("ok", None), link=LATER_LINK)
    snap = build_snapshot(engine, ServingMetrics(), time.monotonic())
    assert snap["link"] == LATER_LINK
    json.dumps(snap, allow_nan=False)


def render_text(link: dict | None, stats: WorkerStats | None = None) -> str:
    engine = FakeEngine(stats or WorkerStats(), ("ok", None), link=link)
    console = Console(record=True, width=120)
    console.print(render_status(build_snapshot(engine, ServingMetrics(), time.monotonic())))
    return console.export_text()


def test_render_shows_the_chain_of_stage_0() -> None:
    text = render_text(STAGE0_LINK)
    assert "link          chain up · 3 stages · epoch 2" in text
    assert "link traffic  sent 3.0 MiB · received 1.5 KiB · batches 40" in text
    assert "look-ahead    hits 9 of 12 steps · retracted 1" in text
    assert "link busy     2.00 s of 80.0 s in llama.cpp (2.5%)" in text
    assert "connections" not in text


def test_render_names_why_the_chain_is_down() -> None:
    down = {**STAGE0_LINK, "chain": {**STAGE0_LINK["chain"], "up": False,
                                     "reason": "gamma at 10.0.0.2:9101: refused"}}
    assert "chain down (gamma at 10.0.0.2:9101: refused) · 3 stages" in render_text(down)


def test_render_shows_the_upstream_traffic_of_a_later_stage() -> None:
    text = render_text(LATER_LINK, WorkerStats(num_direct_iterations=40))
    assert "iterations 0 · direct iterations 40" in text
    assert "link          connections 2 (1 open) · rejected 1 · active sessions 2" in text
    assert "link traffic  received 5.0 MiB · sent 2.0 KiB · batches 40" in text
    assert "link busy     20.00 s of 80.0 s in llama.cpp (25.0%)" in text
    assert "chain" not in text and "look-ahead" not in text


def test_render_of_an_unsplit_stage_has_no_link_block() -> None:
    text = render_text(None)
    assert "link" not in text and "waiting 0" in text


async def test_status_exits_1_when_the_stage_is_not_ok(short_dir: Path) -> None:
    engine = FakeEngine(WorkerStats(), ("draining", "shutting down"))
    metrics = ServingMetrics()
    control = ControlServer(short_dir / "b.sock", stage_id="beta", telemetry=TelemetryHub(),
                            snapshot=lambda: build_snapshot(engine, metrics, time.monotonic()))
    await control.start()
    try:
        console = Console(record=True, width=120)
        code = await asyncio.to_thread(run_status, control.path, None, False, out=console)
    finally:
        await control.close()
    assert code == ExitCode.FAILURE
    assert "draining (shutting down)" in console.export_text()


# -- finding the socket ------------------------------------------------------------------------

def make_socket(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return path


@pytest.fixture
def default_dirs(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point every default socket location inside ``short_dir``."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir / "xdg"))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir / "tmp"))
    monkeypatch.setattr(config_defaults, "SYSTEM_RUNTIME_DIR", short_dir / "run")
    return short_dir


def test_a_system_service_instance_socket_is_found(default_dirs: Path) -> None:
    # skippyd@stage1 (RuntimeDirectory=skippyd/%i) runs stage "stage-1" of a pipeline.
    config = default_dirs / "stage1.toml"
    config.write_text('[stage]\nid = "stage-1"\n')
    instance = make_socket(default_dirs / "run" / "stage1" / "stage-1.sock")
    assert resolve_socket_path(None, config) == instance
    assert resolve_socket_path() == instance  # the only socket around


def test_explicit_socket_and_config_socket_win(short_dir: Path) -> None:
    assert resolve_socket_path(Path("/x/y.sock"), None) == Path("/x/y.sock")
    config = short_dir / "stage.toml"
    config.write_text(f'[stage]\nid = "beta"\n\n[control]\nsocket = "{short_dir}/c.sock"\n')
    assert resolve_socket_path(None, config) == short_dir / "c.sock"


def test_default_locations_are_probed(default_dirs: Path) -> None:
    with pytest.raises(ControlConnectError, match="no control socket found"):
        resolve_socket_path()
    other = make_socket(default_dirs / "tmp" / f"skippyd-{os.getuid()}" / "beta.sock")
    assert resolve_socket_path() == other  # the only one around
    preferred = make_socket(default_dirs / "xdg" / "skippyd" / "stage-0.sock")
    assert resolve_socket_path() == preferred  # the default stage's own socket first
    preferred.unlink()
    make_socket(default_dirs / "xdg" / "skippyd" / "gamma.sock")
    with pytest.raises(ControlConnectError, match="several control sockets"):
        resolve_socket_path()


def test_status_with_a_bad_config_is_a_config_error(short_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = short_dir / "bad.toml"
    config.write_text("[runtime]\nlane_count = 0\n")
    assert run_status(None, config, False) == ExitCode.CONFIG
    assert "runtime.lane_count" in capsys.readouterr().err
    # Bracketed text in a message is not Rich markup, and a long line is not wrapped.
    config.write_text('[stage]\nindex = 1\nlayer_start = 2\n[link]\nlisten = "127.0.0.1:9"\n'
                      '[upstream]\nstage_id = "a"\nendpoint = "127.0.0.1:8"\n[http]\n')
    assert run_status(None, config, False) == ExitCode.CONFIG
    assert ("http: only the first stage serves HTTP (stage.index 1, layer_start 2);"
            " remove [http]") in capsys.readouterr().err.splitlines()
