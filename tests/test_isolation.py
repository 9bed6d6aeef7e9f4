"""The suite runs in private XDG dirs, and its guard notices a change to a default dir."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import isolation
import pytest

from skippyd.config import default_socket_path
from skippyd.model_files.slice import default_slice_cache_dir


def test_this_run_points_every_default_location_at_a_private_dir():
    for name in isolation.XDG_DIRS:
        assert os.environ[name].startswith(str(Path(os.environ["XDG_RUNTIME_DIR"]).parent))
    private = Path(os.environ["XDG_RUNTIME_DIR"]).parent
    assert default_socket_path("stage-0").is_relative_to(private)
    assert default_slice_cache_dir().is_relative_to(private)
    assert "NOTIFY_SOCKET" not in os.environ and "RUNTIME_DIRECTORY" not in os.environ
    # Child processes (every `skippyd serve` a test starts) see the same.
    child = subprocess.run(
        [sys.executable, "-c", "from skippyd.config import default_socket_path as d;"
                               " print(d('stage-0'))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert Path(child.stdout.strip()).is_relative_to(private)


def test_guard_sees_a_created_socket_a_modified_file_and_a_removal(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    dirs = isolation.guarded_dirs(env)
    assert tmp_path / "run" / "skippyd" in dirs
    assert tmp_path / "home" / ".cache" / "skippyd" in dirs
    cache = tmp_path / "home" / ".cache" / "skippyd"
    cache.mkdir(parents=True)
    kept = cache / "kept"
    kept.write_text("a")
    gone = cache / "gone"
    gone.write_text("b")
    before = isolation.snapshot(dirs)
    assert isolation.differences(before, isolation.snapshot(dirs)) == []

    run = tmp_path / "run" / "skippyd"
    run.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(run / "notify.sock"))
    kept.write_text("changed")
    gone.unlink()
    changes = isolation.differences(before, isolation.snapshot(dirs))
    assert f"created socket {run / 'notify.sock'}" in changes
    assert f"modified file {kept}" in changes
    assert f"removed file {gone}" in changes


def test_a_run_that_writes_into_a_default_dir_fails(pytester, monkeypatch):
    here = Path(__file__).parent
    for helper in ("conftest.py", "isolation.py", "tiny_model.py"):
        (pytester.path / helper).write_text((here / helper).read_text())
    # The inner run guards the (private) cache dir this run gave it as its default.
    target = Path(os.environ["XDG_CACHE_HOME"]) / "skippyd"
    monkeypatch.setenv("GUARD_TARGET", str(target))
    pytester.makepyfile(test_polluter="""
import os
from pathlib import Path

def test_leaves_a_file_behind():
    target = Path(os.environ["GUARD_TARGET"])
    target.mkdir(parents=True, exist_ok=True)
    (target / "leftover.sock").write_text("")
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*changed the user's default directories*",
                                 f"*created file {target / 'leftover.sock'}*"])
