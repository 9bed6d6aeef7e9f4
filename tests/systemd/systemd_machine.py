"""A real systemd, booted as PID 1 of a container over a root tree of its own.

The tree is a minimal Debian of the host's release (``mmdebstrap``, else ``debootstrap``)
with systemd and the shared libraries the project's Python needs. It is built once and
kept under ``~/.cache/skippyd-tests/systemd/`` (``SKIPPYD_TEST_CACHE`` moves it); a
build takes about a minute. ``systemd-nspawn --boot --volatile=overlay`` boots it with a
tmpfs over the tree, so whatever a test installs or writes is gone after the boot and
several boots can share one tree.

Inside, skippyd is installed the way a user would: a venv at ``/opt/skippyd/venv`` with
its script linked to ``/usr/local/bin/skippyd`` (where the example units look). The
venv's Python, packages, embedded model and skippyd source are the test run's own,
mounted read-only below ``/opt/skippyd``, outside the directories the units hide
(``ProtectHome=``).

Commands run inside with ``nsenter`` (the host's PID 1 need not be systemd, and
``machinectl`` needs it to be). The daemons listen on the host's loopback: the container
shares the host's network.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import skippyd

#: Debian packages of the tree: systemd as PID 1, and what the project's Python and
#: llama.cpp link against that a minimal Debian lacks.
PACKAGES = ("systemd", "systemd-sysv", "libffi8", "libssl3", "libsqlite3-0", "libexpat1",
            "libgomp1", "libstdc++6", "zlib1g", "libbz2-1.0", "liblzma5", "libuuid1")
#: Bumped when the way the tree is built changes, so that an old cached tree is not used.
TREE_FORMAT = 1
#: Where the project is mounted inside the container.
OPT = Path("/opt/skippyd")
VENV = OPT / "venv"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PR_SET_PDEATHSIG = 1


class Unbootable(Exception):
    """No systemd can be booted here; the message says why."""


def cache_dir() -> Path:
    """Where built trees are kept between runs (never inside the repository)."""
    configured = os.environ.get("SKIPPYD_TEST_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "skippyd-tests"
    return base / "systemd"


def host_release() -> str:
    """The codename of the host's Debian release: the tree's libraries must be at least
    as new as the ones the venv's native code was built against."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            key, _, value = line.partition("=")
            fields[key] = value.strip().strip('"')
    if fields.get("ID") != "debian" or not fields.get("VERSION_CODENAME"):
        raise Unbootable(f"the container tree is built from Debian's packages of the host's "
                         f"release, and this host is not Debian ({fields.get('ID', '?')})")
    return fields["VERSION_CODENAME"]


def check_host() -> None:
    """Raise :class:`Unbootable` with the reason when this host cannot boot the container."""
    if os.geteuid() != 0:
        raise Unbootable("booting a container with systemd-nspawn needs root")
    if shutil.which("systemd-nspawn") is None or shutil.which("nsenter") is None:
        raise Unbootable("systemd-nspawn is not installed (Debian package systemd-container; "
                         ".ci/run installs it)")
    if shutil.which("mmdebstrap") is None and shutil.which("debootstrap") is None:
        raise Unbootable("neither mmdebstrap nor debootstrap is installed to build the "
                         "container's tree (.ci/run installs mmdebstrap)")
    if not Path("/sys/fs/cgroup/unified/cgroup.procs").exists() and \
            not Path("/sys/fs/cgroup/cgroup.procs").exists():
        raise Unbootable("no cgroup2 hierarchy to give the container's systemd")
    if Path(sys.base_prefix) == Path("/usr"):
        raise Unbootable("the venv's Python is the host's own /usr: the container can only "
                         "borrow a Python installed in a prefix of its own")


def tree() -> Path:
    """The cached root tree, built first if needed (one builder at a time)."""
    release = host_release()
    key = hashlib.sha256(json.dumps([TREE_FORMAT, release, PACKAGES]).encode()).hexdigest()
    root = cache_dir() / f"{release}-{key[:12]}"
    if (root / "usr/lib/systemd/systemd").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "usr/lib/systemd/systemd").exists():
            _build(release, root)
    return root


def _build(release: str, root: Path) -> None:
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    include = ",".join(PACKAGES)
    if shutil.which("mmdebstrap"):
        command = ["mmdebstrap", "--variant=minbase", f"--include={include}", release,
                   str(partial)]
    else:
        command = ["debootstrap", "--variant=minbase", f"--include={include}", release,
                   str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise Unbootable(f"{command[0]} could not build the container's tree (exit "
                         f"{result.returncode}): {result.stderr.strip()[-1500:]}")
    partial.rename(root)


def _venv_skeleton(directory: Path) -> Path:
    """A venv for /opt/skippyd/venv whose Python and packages are this run's, mounted."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base_executable = Path(getattr(sys, "_base_executable", sys.executable))
    base_python = OPT / "python" / base_executable.relative_to(sys.base_prefix)
    venv = directory / "venv"
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(
        f"home = {base_python.parent}\ninclude-system-site-packages = false\n"
        f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    for name in ("python", "python3", version):
        (venv / "bin" / name).symlink_to(base_python)
    # The run's packages (with their .pth files), then skippyd's own source: an editable
    # install points at a path that does not exist in here.
    (site / "skippyd-test-run.pth").write_text(
        f"import site; site.addsitedir({str(OPT / 'site-packages')!r})\n{OPT / 'src'}\n")
    (venv / "bin" / "skippyd").write_text(
        f"#!{VENV}/bin/python\nimport sys\nfrom skippyd.cli import main\n\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n")
    (venv / "bin" / "skippyd").chmod(0o755)
    return venv


def _bind_mounts(workdir: Path) -> list[str]:
    package = Path(skippyd.__file__).resolve().parent
    return [f"--bind-ro={sys.base_prefix}:{OPT / 'python'}",
            f"--bind-ro={sysconfig.get_paths()['purelib']}:{OPT / 'site-packages'}",
            f"--bind-ro={package}:{OPT / 'src' / 'skippyd'}",
            f"--bind-ro={_venv_skeleton(workdir)}:{VENV}"]


class Machine:
    """A booted container: run commands in it, write files into it, read its journal."""

    def __init__(self, workdir: Path, *, boot_timeout: float = 120.0) -> None:
        check_host()
        self.root_tree = tree()
        self.name = f"skippyd-test-{uuid.uuid4().hex[:8]}"
        self.workdir = workdir
        self.console = workdir / "nspawn.log"
        self._cgroups = [p / self.name for p in (Path("/sys/fs/cgroup/unified"),
                                                 Path("/sys/fs/cgroup/systemd"),
                                                 Path("/sys/fs/cgroup"))
                         if (p / "cgroup.procs").exists()]
        notify_path = workdir / "nspawn-notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        command = ["systemd-nspawn", "--quiet", "--boot", f"--directory={self.root_tree}",
                   "--read-only", "--volatile=overlay", f"--machine={self.name}",
                   "--register=no", "--keep-unit", "--console=pipe", "--notify-ready=yes",
                   *_bind_mounts(workdir)]
        env = {"PATH": PATH, "NOTIFY_SOCKET": str(notify_path),
               # The container's systemd gets a cgroup2 tree of its own, as on a current
               # distribution, even where the host mixes cgroup v1 and v2.
               "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
        try:
            with open(self.console, "wb") as console:
                self.process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=console, stderr=console,
                    env=env, preexec_fn=self._enter_own_cgroup)
            self.leader = 0
            self._wait_booted(notify, boot_timeout)
        except BaseException:
            self.close()
            raise
        finally:
            notify.close()

    def _enter_own_cgroup(self) -> None:
        """In the child before exec: a cgroup of its own, so that containers booted at the
        same time do not share the cgroups nspawn makes beside its own; and SIGTERM (a
        clean halt) if the test run dies without closing the machine."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        for cgroup in self._cgroups:
            cgroup.mkdir(exist_ok=True)
            (cgroup / "cgroup.procs").write_text("0")

    def _wait_booted(self, notify: socket.socket, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unbootable(f"the container did not finish booting in {timeout:.0f} s:\n"
                                 + self.console_log())
            notify.settimeout(min(remaining, 1.0))
            try:
                message = notify.recv(4096).decode()
            except TimeoutError:
                if self.process.poll() is not None:
                    raise Unbootable(f"systemd-nspawn exited with {self.process.returncode}"
                                     f" while booting:\n{self.console_log()}") from None
                continue
            if "READY=1" in message.splitlines():
                break
        self.leader = self._find_leader()
        # The borrowed Python finds its libpython where it was built, a path the units
        # hide: tell the dynamic linker where it is mounted instead.
        libdir = Path(sysconfig.get_config_var("LIBDIR") or sys.base_prefix)
        if libdir.is_relative_to(sys.base_prefix):
            self.write("/etc/ld.so.conf.d/skippyd-python.conf",
                       f"{OPT / 'python' / libdir.relative_to(sys.base_prefix)}\n")
            self.run("ldconfig")

    def _find_leader(self) -> int:
        """The container's PID 1, as the host sees it (nspawn's only child)."""
        tasks = Path(f"/proc/{self.process.pid}/task")
        for task in tasks.iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        raise Unbootable("systemd-nspawn runs no container")

    def console_log(self) -> str:
        with contextlib.suppress(OSError):
            return self.console.read_text(errors="replace")[-4000:]
        return ""

    # -- inside ----------------------------------------------------------------------
    def run(self, *command: str, check: bool = True, timeout: float = 120.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside the container, as root, with a plain environment."""
        nsenter = ["nsenter", f"--target={self.leader}", "--mount", "--uts", "--ipc",
                   "--net", "--pid", "--cgroup", "--root", "--wd", "--",
                   "/usr/bin/env", "-i", f"PATH={PATH}", "LANG=C.UTF-8", "SYSTEMD_COLORS=0",
                   "SYSTEMD_PAGER=", *command]
        result = subprocess.run(nsenter, capture_output=True, text=True, timeout=timeout,
                                input=input, stdin=None if input is not None else
                                subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(f"{shlex.join(command)} exited with {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def sh(self, script: str, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a shell command line inside the container."""
        return self.run("/bin/sh", "-c", script, **kwargs)

    def path(self, inside: str | Path) -> Path:
        """The host's view of a path inside the container."""
        return Path(f"/proc/{self.leader}/root") / Path(inside).relative_to("/")

    def write(self, inside: str | Path, text: str) -> None:
        target = self.path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """``systemctl show`` of ``unit``'s ``properties``."""
        output = self.run("systemctl", "show", unit, "-p", ",".join(properties)).stdout
        return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)

    def cursor(self) -> str:
        """The journal's current end: read what comes after it with :meth:`journal`."""
        output = self.run("journalctl", "--show-cursor", "-n", "0", "-q").stdout
        return output.strip().rpartition("cursor: ")[2]

    def journal(self, *args: str, after: str | None = None) -> list[dict[str, str]]:
        """Journal entries as JSON, e.g. ``journal("-u", "skippyd", "-p", "warning")``."""
        command = ["journalctl", "--no-pager", "-o", "json", *args]
        if after:
            command.append(f"--after-cursor={after}")
        output = self.run(*command).stdout
        return [json.loads(line) for line in output.splitlines() if line.startswith("{")]

    def wait_journal(self, found: Callable[[list[dict[str, str]]], bool], *args: str,
                     after: str | None = None, timeout: float = 30.0) -> list[dict[str, str]]:
        """Read the journal (as :meth:`journal`) until ``found(entries)``: journald files a
        service's lines a moment after it wrote them."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.journal(*args, after=after)
            if found(entries):
                return entries
            if time.monotonic() > deadline:
                raise AssertionError(f"not in the journal ({shlex.join(args)}) after "
                                     f"{timeout:.0f} s:\n" + "\n".join(
                                         str(e.get("MESSAGE")) for e in entries))
            time.sleep(0.2)

    # -- teardown ----------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Halt the container (SIGTERM makes nspawn shut systemd down), then clean up."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        for cgroup in self._cgroups:
            for directory in sorted(_directories(cgroup), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def _directories(root: Path) -> Iterator[Path]:
    if root.is_dir():
        yield root
        for path in root.rglob("*"):
            if path.is_dir():
                yield path
