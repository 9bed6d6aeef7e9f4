"""Keep the suite out of the user's own directories, and prove it did.

:func:`isolate` points every XDG base directory at a private temp dir for the whole
run (child ``skippyd`` processes inherit it), so a daemon started by a test puts its
control socket and its slice cache there. :func:`guarded_dirs` lists the directories a
real user's ``skippyd`` uses by default; the run snapshots them before and compares
after, and fails when anything in them changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

#: XDG variables pointed at the private dir, with the sub-directory each gets.
XDG_DIRS = {"XDG_RUNTIME_DIR": "run", "XDG_CACHE_HOME": "cache",
            "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data", "XDG_STATE_HOME": "state"}

Snapshot = dict[str, tuple[str, int, int]]
"""Path -> (kind, size, mtime in ns) of every entry below the guarded directories."""


def guarded_dirs(environ: Mapping[str, str]) -> list[Path]:
    """The directories a user's skippyd writes to by default, for ``environ``."""
    home = Path(environ.get("HOME") or Path.home())
    dirs = [Path(tempfile.gettempdir()) / f"skippyd-{os.getuid()}",
            Path(f"/run/user/{os.getuid()}") / "skippyd",
            Path(environ.get("XDG_CACHE_HOME") or home / ".cache") / "skippyd",
            Path(environ.get("XDG_CONFIG_HOME") or home / ".config") / "skippyd",
            Path(environ.get("XDG_DATA_HOME") or home / ".local" / "share") / "skippyd",
            Path(environ.get("XDG_STATE_HOME") or home / ".local" / "state") / "skippyd"]
    if environ.get("XDG_RUNTIME_DIR"):
        dirs.insert(0, Path(environ["XDG_RUNTIME_DIR"]) / "skippyd")
    return list(dict.fromkeys(dirs))


def snapshot(dirs: Iterable[Path]) -> Snapshot:
    """Every file, socket and directory below ``dirs`` (missing dirs are empty)."""
    found: Snapshot = {}
    for root in dirs:
        if not root.is_dir():
            continue
        for path in [root, *root.rglob("*")]:
            try:
                info = path.lstat()
            except FileNotFoundError:  # removed while walking
                continue
            kind = "dir" if path.is_dir() else "socket" if path.is_socket() else "file"
            found[str(path)] = (kind, 0 if kind == "dir" else info.st_size,
                                0 if kind == "dir" else info.st_mtime_ns)
    return found


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """Human-readable changes from ``before`` to ``after``, sorted by path."""
    changes = []
    for path in sorted(before.keys() | after.keys()):
        if path not in before:
            changes.append(f"created {after[path][0]} {path}")
        elif path not in after:
            changes.append(f"removed {before[path][0]} {path}")
        elif before[path] != after[path]:
            changes.append(f"modified {after[path][0]} {path}")
    return changes


def isolate(environ: MutableMapping[str, str]) -> Path:
    """Point the XDG directories of ``environ`` at a new private dir and return it.

    The dir's name is short on purpose: sockets made below it must fit ``sun_path``.
    """
    root = Path(tempfile.mkdtemp(prefix="skt"))
    for name, sub in XDG_DIRS.items():
        (root / sub).mkdir(mode=0o700)
        environ[name] = str(root / sub)
    # A systemd unit's directories would win over the XDG ones: never the real ones here.
    for name in ("RUNTIME_DIRECTORY", "CACHE_DIRECTORY", "STATE_DIRECTORY", "NOTIFY_SOCKET",
                 "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        environ.pop(name, None)
    return root


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
