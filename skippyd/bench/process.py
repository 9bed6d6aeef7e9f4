"""Server processes a benchmark run owns: started, waited on until ready, stopped.

:class:`ServerProcess` starts ``skippyd serve`` (``skippyd bench --config``) and the
anchors of the ``bench/`` scripts, reads their output on a thread, and stops them with
SIGTERM afterwards; :func:`sigterm_exits` makes a SIGTERM to the benchmark stop them too.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skippyd.bench.loadgen import BenchError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180.0
_LOG_TAIL_LINES = 40
#: The line ``skippyd serve`` prints on stderr once it accepts requests.
SKIPPYD_READY = r"skippyd serving \S+ on (?P<url>http://\S+/v1)"


@dataclass(slots=True)
class _TermState:
    """SIGTERM handling of :func:`sigterm_exits`: deferred while a child is being spawned."""

    deferring: bool = False
    pending: int | None = None


_term = _TermState()


def _on_sigterm(signum: int, frame: object) -> None:
    if _term.deferring:
        _term.pending = signum
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` (main thread only), so ``with`` blocks that own
    server processes still stop them; the previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_deferred() -> Iterator[None]:
    # NOTE: a SystemExit raised inside Popen() would lose the child it just started.
    _term.deferring, _term.pending = True, None
    try:
        yield
    finally:
        _term.deferring = False
    if _term.pending is not None:
        raise SystemExit(128 + _term.pending)


def free_port() -> int:
    """A loopback port free right now, for a server that cannot report one it picked."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server child process started for a run, stopped with SIGTERM afterwards.

    Its output is read on a thread (so the pipe never fills); :meth:`start` returns
    once a line matches ``ready_pattern``, whose ``url`` group becomes :attr:`url`.
    """

    def __init__(self, argv: Sequence[str], ready_pattern: str, *, name: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.url = ""
        self._argv = list(argv)
        self._env = None if env is None else {**os.environ, **env}
        self._ready = re.compile(ready_pattern)
        self._lines: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Start the process and wait for its ready line.

        Raises:
            BenchError: It exits or stays silent for ``timeout_s`` (then it is stopped).
        """
        try:
            with _sigterm_deferred():
                self._proc = subprocess.Popen(
                    self._argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, errors="replace", env=self._env)
            threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()
            self._wait_ready(self._proc, time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("%s ready at %s", self.name, self.url)
        return self

    def _wait_ready(self, proc: subprocess.Popen[str], deadline: float) -> None:
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"{self.name} did not get ready in time:\n"
                                 + self.log_tail()) from None
            if line is None:
                raise BenchError(f"{self.name} exited with code {proc.wait()} before it was "
                                 "ready:\n" + self.log_tail())
            match = self._ready.search(line)
            if match:
                self.url = match.groupdict().get("url") or ""
                return

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._lines.append(line)
            self._queue.put(line)
        self._queue.put(None)  # end of output: the process exited

    @property
    def pid(self) -> int | None:
        """The process id once started."""
        return None if self._proc is None else self._proc.pid

    def log_tail(self) -> str:
        """The last lines the process printed."""
        return "".join(self._lines)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; idempotent. Returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                return self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %g s; killing it", self.name, timeout_s)
                self._proc.kill()
        return self._proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) each thread of process ``pid`` has used so far.

    Read from ``/proc``; empty where there is none (not Linux) or the process is gone.
    A thread that exits between the listing and its read is left out.
    """
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return seconds
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as stat:
                # Fields after the parenthesised name; utime and stime are the 14th and
                # 15th of the whole line.
                fields = stat.read().rpartition(")")[2].split()
            seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return seconds


def cpu_per_token(before: dict[int, float], after: dict[int, float], wall_s: float,
                  tokens: int) -> dict[str, float]:
    """A server's CPU per output token, split between its busy threads and the rest.

    Busy threads ran for more than half the wall time: llama.cpp's compute threads
    (they spin between graph nodes), which in skippyd include the worker thread and
    its Python between decodes. The rest is the HTTP side: skippyd's event loop,
    llama-server's HTTP threads. When every core is busy, the rest takes its CPU from the
    busy threads. Empty when the per-thread CPU cannot be read (not Linux).
    """
    if not after or tokens <= 0 or wall_s <= 0:
        return {}
    used = [after[tid] - before.get(tid, 0.0) for tid in after]
    busy = sum(u for u in used if u > wall_s / 2)
    return {"cpu_busy_ms_per_token": busy / tokens * 1000.0,
            "cpu_rest_ms_per_token": (sum(used) - busy) / tokens * 1000.0}


def skippyd_process(config_path: str, *, extra_args: Sequence[str] = (),
                    env: Mapping[str, str] | None = None) -> ServerProcess:
    """A ``skippyd serve`` of ``config_path`` on a free loopback port (``env`` adds
    environment variables)."""
    argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", config_path,
            "--listen", "127.0.0.1:0", *extra_args]
    return ServerProcess(argv, SKIPPYD_READY, name="skippyd", env=env)


#: The line a later stage of a split pipeline prints once its link listens.
STAGE_READY = r"skippyd stage \S+ serving layers \S+ on link \S+"
#: How long a started pipeline may take to connect end to end.
PIPELINE_CONNECT_TIMEOUT_S = 60.0


@contextlib.contextmanager
def skippyd_pipeline(config_paths: Sequence[str], *,
                     connect_timeout_s: float = PIPELINE_CONNECT_TIMEOUT_S
                     ) -> Iterator[ServerProcess]:
    """Every stage of a split pipeline (configs in stage order), started for a run.

    Later stages start first (last one first); stage 0 gets a free loopback HTTP port.
    Yields stage 0 once its ``/health`` says the whole chain is connected; stops every
    stage afterwards.

    Raises:
        BenchError: A stage does not start, or the chain does not connect in time.
    """
    with contextlib.ExitStack() as stack:
        for index in range(len(config_paths) - 1, 0, -1):
            argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config",
                    config_paths[index]]
            stack.enter_context(ServerProcess(argv, STAGE_READY, name=f"stage {index}"))
        head = stack.enter_context(skippyd_process(config_paths[0]))
        wait_pipeline_connected(head.url, connect_timeout_s, head=head)
        yield head


def wait_pipeline_connected(url: str, timeout_s: float = PIPELINE_CONNECT_TIMEOUT_S, *,
                            head: ServerProcess | None = None) -> None:
    """Poll stage 0's ``/health`` at ``url`` until the whole chain is connected.

    Raises:
        BenchError: Not connected within ``timeout_s`` (with the reason stage 0 gives,
            and ``head``'s last log lines when given).
    """
    import httpx  # deferred: only pipelines poll health

    health = url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(health, timeout=5, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            body = {}
        if body.get("status") == "ok":
            return
        time.sleep(0.1)  # stage 0 dials the chain with backoff: poll its health
    raise BenchError(f"the pipeline did not connect in {timeout_s:.0f} s: "
                     f"{body.get('reason', 'no answer')}"
                     + ("" if head is None else "\n" + head.log_tail()))
