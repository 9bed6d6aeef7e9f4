"""The example systemd units verify and keep the daemon's hardening and notify settings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from skippyd.exitcodes import ExitCode

UNITS = Path(__file__).resolve().parents[2] / "examples" / "systemd"


@pytest.mark.parametrize("unit", ["skippyd.service", "skippyd@.service"])
def test_unit_files_verify(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    target = tmp_path / (unit.replace("@", "@stage0") if "@" in unit else unit)
    target.write_text((UNITS / unit).read_text())
    result = subprocess.run([analyze, "verify", str(target)], capture_output=True, text=True,
                            timeout=60)
    # The ExecStart binary need not exist on a build machine; every other finding counts.
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "skippyd" not in line.split(":")[0]
                and "is not executable" not in line and "No such file" not in line]
    assert result.returncode == 0 or not problems, result.stdout + result.stderr
    text = (UNITS / unit).read_text()
    for directive in ("Type=notify", "NoNewPrivileges=yes", "ProtectSystem=strict",
                      "ProtectHome=yes", "PrivateTmp=yes", "Restart=on-failure",
                      "RuntimeDirectory=skippyd", "WatchdogSec="):
        assert directive in text
    prevented = f"RestartPreventExitStatus={int(ExitCode.CONFIG)} {int(ExitCode.MODEL)}"
    assert prevented in text
