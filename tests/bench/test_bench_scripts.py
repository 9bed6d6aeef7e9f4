"""The scripts under ``bench/`` import what they use from skippyd and parse their options.

They are run by hand, not by the suite, so a refactor that moves a name they import
would otherwise only show the next time someone measures.
"""

from __future__ import annotations

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
