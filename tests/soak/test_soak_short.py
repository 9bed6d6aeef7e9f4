"""The short soak that CI runs: bench/soak.py against a real daemon on the tiny model."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def _single_config(tmp_path, tiny_model_path) -> Path:
    config = tmp_path / "soak.toml"
    config.write_text(f"""
[stage]
id = "soak"
model_path = "{tiny_model_path}"

[runtime]
ctx_size = 4096
lane_count = 4
threads = 2
threads_batch = 2
queue_capacity = 16

[http]
listen = "127.0.0.1:0"

[control]
socket = "{tmp_path / 'control.sock'}"
""")
    return config


def test_short_soak_leaves_nothing_behind(tmp_path, tiny_model_path):
    config = _single_config(tmp_path, tiny_model_path)
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(SOAK), "--config", str(config), "--requests", "200",
         "--warmup", "32", "--max-output", "16", "--json", str(report), "--attack",
         "--attack-idle", "300"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(report.read_text())
    assert sum(figures["outcomes"].values()) == 200
    assert figures["outcomes"].get("error", 0) == 0
    assert figures["outcomes"].get("disconnected", 0) > 0  # the disconnect path ran
    assert figures["outcomes"].get("invalid->4xx", 0) > 0  # and the invalid one
    assert all(figures["checks"].values()), figures["checks"]
    attacks = figures["attacks"]
    assert attacks["probe_failures"] == 0 and attacks["probe_answers"]["200"] > 0
    assert attacks["idle"]["opened"] >= 300


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_soak_stops_its_daemon(tmp_path, tiny_model_path, sig):
    config = _single_config(tmp_path, tiny_model_path)
    soak = subprocess.Popen([sys.executable, str(SOAK), "--config", str(config),
                             "--requests", "100000", "--warmup", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "control.sock").exists() and _children(soak.pid)):
            assert soak.poll() is None and time.monotonic() < deadline, "no daemon started"
            time.sleep(0.1)
        daemons = _children(soak.pid)
        assert daemons, "the soak started no daemon"
        soak.send_signal(sig)
        soak.wait(timeout=120)
        deadline = time.monotonic() + 120
        while any(_alive(pid) for pid in daemons):
            assert time.monotonic() < deadline, "the daemon outlived its soak"
            time.sleep(0.1)
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("restart", [False, True], ids=["steady", "stage-1-killed"])
def test_short_soak_of_a_split_pipeline_checks_every_stage(tmp_path, tiny_model_path,
                                                            restart):
    ports = [_free_port(), _free_port()]
    secret = "soak-split-shared-secret-0123456789"
    configs = []
    for index, (start, end) in enumerate([(0, 2), (2, 4)]):
        text = f"""
[stage]
id = "soak-{index}"
index = {index}
model_path = "{tiny_model_path}"
layer_start = {start}
layer_end = {end}

[runtime]
ctx_size = 4096
lane_count = 4
threads = 1
threads_batch = 1
queue_capacity = 16
slice_cache_dir = "{tmp_path / 'slices'}"

[link]
listen = "127.0.0.1:{ports[index]}"
secret = "{secret}"

[control]
socket = "{tmp_path / f'stage{index}.sock'}"
"""
        if index == 0:
            text += (f'[http]\nlisten = "127.0.0.1:0"\n[downstream]\nstage_id = "soak-1"\n'
                     f'endpoint = "127.0.0.1:{ports[1]}"\n')
        else:
            text += f'[upstream]\nstage_id = "soak-0"\nendpoint = "127.0.0.1:{ports[0]}"\n'
        path = tmp_path / f"stage{index}.toml"
        path.write_text(text)
        configs += ["--config", str(path)]
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(SOAK), *configs, "--requests", "120", "--warmup", "16",
         "--max-output", "12", "--json", str(report),
         *(["--restart-stage", "1"] if restart else [])],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(report.read_text())
    assert [stage["stage"] for stage in figures["stages"]] == ["stage0", "stage1"]
    assert figures["outcomes"].get("error", 0) == 0
    assert figures["outcomes"].get("disconnected", 0) > 0
    assert all(figures["checks"].values()), figures["checks"]
    assert "stage1:" in result.stdout  # one summary line per stage
    # A killed stage is started again, and counted from its restart; nothing leaks.
    assert (figures["stages"][1]["restarted_at_s"] is not None) == restart
    # Only requests in flight at the kill may fail: the second half runs through the
    # restarted stage (a 20 % disconnect and 5 % invalid share leaves ~75 % ok).
    assert figures["outcomes"].get("ok", 0) > 120 // 2
