"""The link view on the control socket: what ``skippyd status`` shows on each stage of a chain."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from link_support import SECRET, tiny_chain, wait_until

from skippyd.config import parse_config
from skippyd.daemon.split import make_split
from skippyd.engine.runtime.pipeline_types import StageTimeline
from skippyd.engine.worker.worker_stats import WorkerStats
from skippyd.link.dialer import query_status
from skippyd.link.listener import LISTENER_COUNTERS


class FakeLocalRuntime:
    """The facts a split stage reads from its llama.cpp runtime at construction."""

    n_embd = 64
    lane_count = 2
    max_session_tokens = 256
    max_batch_tokens = 128
    info = SimpleNamespace(n_layer=2)
    timeline = StageTimeline()
    busy_s = 0.0

    def __init__(self) -> None:
        self.sessions: set[str] = set()

    # Stage 0 times its decode steps on the runtime when it starts.
    def ensure_session_active(self, session_id: str) -> None:
        self.sessions.add(session_id)

    def run_iteration(self, requests) -> None:
        assert {request.session_id for request in requests} <= self.sessions

    def drop_session(self, session_id: str) -> None:
        self.sessions.remove(session_id)


class FakeWorker:
    def stats(self) -> WorkerStats:
        return WorkerStats(active_runtime_sessions=1)


def later_stage_config():
    return parse_config({
        "stage": {"id": "tiny-1", "index": 1, "layer_start": 2, "layer_end": 4},
        "link": {"listen": "127.0.0.1:0", "secret": SECRET},
        "upstream": {"stage_id": "tiny-0", "endpoint": "127.0.0.1:9"},
    })


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for AF_UNIX socket paths (tmp_path can be too long)."""
    path = Path(tempfile.mkdtemp(prefix="slv"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_snapshot_link_matches_the_status_reply() -> None:
    split = make_split(later_stage_config(), FakeLocalRuntime())
    split.start(FakeWorker())
    try:
        view = split.link_status()
        reply = query_status(split.link_address, SECRET.encode())
    finally:
        split.close()
    assert view.keys() == reply.keys()
    assert {**view, "uptime_s": 0} == {**reply, "uptime_s": 0}
    assert (view["stage_id"], view["stage_index"], view["is_final"]) == ("tiny-1", 1, True)
    assert view["active_sessions"] == 1 and view["busy_s"] == 0.0 and "chain" not in view


def test_stage_0_without_a_listener_reports_zero_listener_counters() -> None:
    config = parse_config({
        "stage": {"id": "tiny-0", "index": 0, "layer_start": 0, "layer_end": 2},
        "link": {"secret": SECRET},
        "downstream": {"stage_id": "tiny-1", "endpoint": "127.0.0.1:9"},
    })
    local = FakeLocalRuntime()
    split = make_split(config, local)
    try:
        view = split.link_status()  # not started: the chain is not dialled
    finally:
        split.close()
    assert len(view["decode_step_ms"]) == local.lane_count and not local.sessions
    assert {key: view[key] for key in (*LISTENER_COUNTERS, "chains")} == dict.fromkeys(
        (*LISTENER_COUNTERS, "chains"), 0)
    assert view["chain"] == {"up": False, "reason": "connecting", "epoch": 0, "num_stages": 2,
                             "bytes_out": 0, "bytes_in": 0}
    assert view["batches_sent"] == view["lookahead_steps"] == 0
    json.dumps(view, allow_nan=False)


def status_json(socket: Path) -> dict:
    """``skippyd status --json`` against ``socket``, as a user would run it."""
    result = subprocess.run(
        [sys.executable, "-m", "skippyd.cli", "status", "--socket", str(socket), "--json"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_status_shows_the_link_on_both_stages(short_dir: Path, tiny_model_path: Path) -> None:
    with tiny_chain(tiny_model_path, short_dir) as (head, _later):

        def health() -> str:
            return httpx.get(head.base_url + "/health", timeout=5).json()["status"]

        wait_until(lambda: health() == "ok", 30, "the chain to connect")
        reply = httpx.post(head.url + "/completions",
                           json={"prompt": "the cat", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200, reply.text
        first = status_json(short_dir / "tiny0.sock")
        second = status_json(short_dir / "tiny1.sock")
    chain = first["link"]["chain"]
    assert chain["up"] is True and chain["num_stages"] == 2 and chain["bytes_out"] > 0
    assert first["link"]["stage_index"] == 0 and first["link"]["batches_sent"] > 0
    link = second["link"]
    assert second["stage"]["index"] == link["stage_index"] == 1
    assert link["bytes_in"] > 0 and link["connections"] >= 1 and link["batches"] > 0
    # A later stage runs stage 0's batches as direct iterations, never planned ones.
    assert second["counters"]["direct_iterations"] > 0
    assert second["counters"]["iterations"] == 0
    assert "chain" not in link
