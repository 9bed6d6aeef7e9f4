"""Start a real ``skippyd serve`` process and wait for its ready line (no sleeps)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

READY = re.compile(r"skippyd serving (?P<model>\S+) on (?P<url>http://\S+/v1)")


class ServeProcess:
    """A ``skippyd serve`` child process with its stderr captured line by line."""

    def __init__(self, config_text: str, workdir: Path, *, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, journal: bool = False) -> None:
        """``journal``: stderr is a pipe that ``JOURNAL_STREAM`` names, as under systemd."""
        self.config_path = workdir / "stage.toml"
        self.config_path.write_text(config_text)
        env = dict(os.environ if env is None else env)
        read_fd, write_fd = os.pipe()
        if journal:
            info = os.fstat(write_fd)
            env["JOURNAL_STREAM"] = f"{info.st_dev}:{info.st_ino}"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skippyd.cli", "serve", "--config",
                 str(self.config_path), *extra_args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_fd, env=env,
            )
        finally:
            os.close(write_fd)
        self._stderr = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""
        self.model = ""

    def _read(self) -> None:
        for line in self._stderr:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_ready(self, timeout: float = 120.0) -> ServeProcess:
        """Block until the daemon prints its ready line; raise with its log otherwise."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError("skippyd did not become ready:\n" + self.log()) from None
            if line is None:
                raise RuntimeError(f"skippyd exited ({self.proc.wait()}):\n" + self.log())
            match = READY.search(line)
            if match:
                self.url, self.model = match["url"], match["model"]
                return self

    def wait_for_line(self, pattern: str, timeout: float = 30.0) -> str:
        regex = re.compile(pattern)
        for line in self.lines:
            if regex.search(line):
                return line
        while True:
            line = self._queue.get(timeout=timeout)
            if line is None:
                raise RuntimeError(f"exited before logging {pattern!r}:\n" + self.log())
            if regex.search(line):
                return line

    @property
    def base_url(self) -> str:
        return self.url.removesuffix("/v1")

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reader.join(timeout)
            if not self._reader.is_alive():
                self._stderr.close()


LANES = 8


def stage_config(*, lanes: int = LANES, queue_capacity: int = 64, ctx_size: int = 4096,
                 socket: str | None = None, extra: str = "", kv_layout: str = "unified") -> str:
    control = f'[control]\nsocket = "{socket}"\n' if socket else ""
    return f"""
[stage]
id = "e2e"

[runtime]
ctx_size = {ctx_size}
lane_count = {lanes}
threads = 2
threads_batch = 2
queue_capacity = {queue_capacity}
kv_layout = "{kv_layout}"

[http]
listen = "127.0.0.1:0"
{extra}
{control}"""
