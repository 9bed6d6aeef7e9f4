"""The scripts under ``bench/`` import what they use from skippyd and parse their options.

They are run by hand, not by the suite, so a refactor that moves a name they import
would otherwise only show the next time someone measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH_DIR.glob("*.py"))


def test_the_bench_directory_has_scripts() -> None:
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_script_imports_and_prints_its_help(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower()


def test_chunk_cost_measures_every_chunk_size(tiny_model_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "chunk_cost.py"), "--model", str(tiny_model_path),
         "--threads", "1", "--prompt-tokens", "100", "--decoders", "2", "--chunks", "30,65",
         "--reps", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in result.stdout.splitlines() if " ms " in line and "│" in line]
    # The chunk size and the calls it takes: one call, 2 chunks of 65, 4 of 30.
    assert [row[:2] for row in rows] == [["one call", "1"], ["65", "2"], ["30", "4"]]
    assert rows[0][4] == "1.000"
    assert "decode rows alone" in result.stdout


def test_chunk_cost_rejects_bad_sizes() -> None:
    result = subprocess.run([sys.executable, str(BENCH_DIR / "chunk_cost.py"), "--chunks",
                             "64,abc"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--chunks" in result.stderr


def test_kv_layout_compares_both_layouts_with_their_kv_bytes(tiny_model_path: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "layout.json"
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "kv_layout.py"), "--model", str(tiny_model_path),
         "--threads", "1", "--lanes", "2", "--prompt-tokens", "20", "--ctx", "256",
         "--steps", "4", "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [row["variant"] for row in report["variants"]] == ["unified", "per_lane"]
    # 4 layers x 2 KV heads x 16 wide, K and V, 2 bytes each.
    assert {row["kv_bytes_per_token"] for row in report["variants"]} == {4 * 2 * 16 * 2 * 2}
    assert report["variants"][0]["ratio_to_unified"] == 1.0


def test_wave_ttft_lists_every_request_of_the_run(tiny_model_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "wave_ttft.py"), "--model", str(tiny_model_path),
         "--threads", "1", "--streams", "2", "--requests", "4", "--prompt-words", "8",
         "--output-tokens", "3", "--ctx", "512"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("skippyd: sent") and "median time to first token" in lines[-1]
    rows = [line.split() for line in lines[1:-1]]
    assert len(rows) == 4 and all(len(row) == 3 for row in rows), result.stdout
    sent, ttft, first = (float(cell) for cell in rows[-1])
    assert ttft > 0 and abs(sent + ttft - first) < 2e-3


def test_wave_ttft_rejects_a_run_without_streams() -> None:
    result = subprocess.run([sys.executable, str(BENCH_DIR / "wave_ttft.py"), "--streams",
                             "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--streams" in result.stderr
