"""The example systemd units verify clean, rate well in `systemd-analyze security`, and keep
the daemon's restart, runtime-directory, notify and hardening settings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippyd.exitcodes import ExitCode

UNITS = Path(__file__).resolve().parents[2] / "examples" / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian package systemd; "
                            ".ci/run installs it)")
#: Where each example is installed to be checked: the template as one of its instances.
INSTALLED = {"skippyd.service": "skippyd.service", "skippyd@.service": "skippyd@stage0.service"}
#: Findings of `systemd-analyze security` the units leave open on purpose (each is
#: explained in the unit's comment).
DELIBERATELY_OPEN = {"RootDirectoryOrRootImage", "MemoryDenyWriteExecute", "PrivateUsers",
                     "ProcSubset", "PrivateNetwork", "IPAddressDeny", "DeviceAllow",
                     "RestrictAddressFamilies_AF_UNIX", "RestrictAddressFamilies_AF_INET_INET6"}
MAX_EXPOSURE = 2.0


def install(unit: str, directory: Path, *, extra: str = "") -> Path:
    """Copy ``unit`` as installed, its ExecStart pointing at this environment's skippyd."""
    text = (UNITS / unit).read_text()
    skippyd = Path(sys.executable).with_name("skippyd")
    text = text.replace("/usr/local/bin/skippyd", str(skippyd))
    if extra:
        text = text.replace("[Service]\n", f"[Service]\n{extra}\n", 1)
    target = directory / INSTALLED[unit]
    target.write_text(text)
    return target


def verify_findings(path: Path) -> list[str]:
    """Every line `systemd-analyze verify` prints about ``path``: each one is a finding."""
    result = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True,
                            timeout=60)
    findings = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if result.returncode != 0 and not findings:
        findings = [f"systemd-analyze verify exited with {result.returncode}"]
    return findings


@needs_analyze
@pytest.mark.parametrize("unit", sorted(INSTALLED))
def test_units_verify_without_a_single_finding(unit, tmp_path):
    assert verify_findings(install(unit, tmp_path)) == []


@needs_analyze
def test_verify_catches_a_bogus_key(tmp_path):
    findings = verify_findings(install("skippyd@.service", tmp_path, extra="Bogus=yes"))
    assert any("Bogus" in line for line in findings), findings


@needs_analyze
@pytest.mark.parametrize("unit", sorted(INSTALLED))
def test_units_are_hardened(unit, tmp_path):
    path = install(unit, tmp_path)
    result = subprocess.run([ANALYZE, "security", "--offline=yes", "--json=short", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    findings = json.loads(result.stdout)
    open_ones = {f["json_field"] for f in findings if not f["set"]}
    assert open_ones <= DELIBERATELY_OPEN, sorted(open_ones - DELIBERATELY_OPEN)
    rated = subprocess.run([ANALYZE, "security", "--offline=yes",
                            f"--threshold={MAX_EXPOSURE * 10:.0f}", str(path)],
                           capture_output=True, text=True, timeout=60)
    exposure = re.search(r"Overall exposure level for \S+: ([\d.]+)", rated.stdout)
    assert exposure is not None, rated.stdout + rated.stderr
    assert float(exposure[1]) <= MAX_EXPOSURE and rated.returncode == 0, rated.stdout


@pytest.mark.parametrize("unit", sorted(INSTALLED))
def test_units_keep_restart_notify_and_directory_settings(unit):
    text = (UNITS / unit).read_text()
    settings = {line.split("=", 1)[0]: line.split("=", 1)[1]
                for line in text.splitlines() if "=" in line and not line.startswith("#")}
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    assert set(settings["RestartPreventExitStatus"].split()) == {
        str(int(ExitCode.CONFIG)), str(int(ExitCode.MODEL))}
    assert int(settings["StartLimitBurst"]) > 1 and int(settings["StartLimitIntervalSec"]) > 0
    assert int(settings["WatchdogSec"]) > 0 and int(settings["TimeoutStartSec"]) > 0
    # An instance removing its runtime directory on stop must not take another's socket.
    expected = "skippyd/%i" if "@" in unit else "skippyd"
    assert settings["RuntimeDirectory"] == expected
    for directive in ("NoNewPrivileges", "ProtectSystem", "ProtectClock", "ProtectKernelLogs",
                      "ProtectProc", "SystemCallFilter", "CapabilityBoundingSet"):
        assert directive in settings
