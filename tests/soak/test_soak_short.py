"""The short soak that CI runs: bench/soak.py against a real daemon on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_short_soak_leaves_nothing_behind(tmp_path, tiny_model_path):
    config = tmp_path / "soak.toml"
    config.write_text(f"""
[stage]
id = "soak"
model_path = "{tiny_model_path}"

[runtime]
ctx_size = 2048
lane_count = 4
threads = 2
threads_batch = 2
queue_capacity = 16

[http]
listen = "127.0.0.1:0"

[control]
socket = "{tmp_path / 'control.sock'}"
""")
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(SOAK), "--config", str(config), "--requests", "200",
         "--warmup", "32", "--max-output", "16", "--json", str(report)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(report.read_text())
    assert sum(figures["outcomes"].values()) == 200
    assert figures["outcomes"].get("error", 0) == 0
    assert figures["outcomes"].get("disconnected", 0) > 0  # the disconnect path ran
    assert figures["outcomes"].get("invalid->4xx", 0) > 0  # and the invalid one
    assert all(figures["checks"].values()), figures["checks"]
