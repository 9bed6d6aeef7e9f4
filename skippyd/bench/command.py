"""``skippyd bench``: a one-shot load benchmark of OpenAI-compatible endpoints.

It measures skippyd (started for the run from ``--config``) or any endpoint (``--url``),
optionally side by side with a second one (``--vs``), with streaming ``/v1/completions``
requests. ``--lab`` runs the scheduler lab instead (modelled times, no server).

:class:`ServerProcess` starts the servers a run owns (``skippyd serve`` here, the anchors
in ``bench/`` scripts) and stops them afterwards, SIGTERM to the benchmark included.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from skippyd.bench.loadgen import (
    DEFAULT_TIMEOUT_S,
    BenchError,
    TargetRun,
    make_client,
    resolve_target,
    run_benchmark,
)
from skippyd.bench.report import (
    RichProgress,
    comparison_rows,
    comparison_table,
    error_lines,
    level_metrics,
    report_to_json,
    target_tables,
)
from skippyd.bench.workload import (
    WorkloadError,
    WorkloadSpec,
    parse_concurrency,
    parse_range,
)

logger = logging.getLogger(__name__)

app = typer.Typer(add_completion=False)
# NOTE: a pipe gets 120 columns, not rich's default 80, so the tables stay readable in logs.
stdout = Console(width=None if Console().is_terminal else 120)
stderr = Console(stderr=True)

EXIT_FAILED = 1
EXIT_USAGE = 2


def _fail(message: str, code: int) -> typer.Exit:
    stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _concurrency(text: str) -> str:
    try:
        parse_concurrency(text)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from None
    return text


def _length_range(text: str) -> str:
    try:
        parse_range(text, "value")
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc).removeprefix("value: ")) from None
    return text


def _opt(*names: str, **kwargs) -> typer.models.OptionInfo:
    return typer.Option(*names, show_default=kwargs.pop("show_default", False), **kwargs)


ConfigOpt = Annotated[Path | None, _opt(
    "--config", help="Start skippyd with this stage config for the run, then stop it.")]
UrlOpt = Annotated[str | None, _opt(
    help="An OpenAI-compatible endpoint to measure (e.g. http://127.0.0.1:8080/v1).")]
VsOpt = Annotated[str | None, _opt(
    help="A second endpoint measured in the same run, level by level; prints ratios.")]
ModelOpt = Annotated[str | None, _opt(
    help="Model name to request (default: the first id of /v1/models).")]
VsModelOpt = Annotated[str | None, _opt(help="Model name for --vs.")]
ApiKeyOpt = Annotated[str | None, _opt(envvar="SKIPPYD_BENCH_API_KEY",
                                       help="Bearer key for --url (--config: the config's).")]
VsApiKeyOpt = Annotated[str | None, _opt(help="Bearer key for --vs.")]
LevelsOpt = Annotated[str, _opt("--concurrency", "-c", callback=_concurrency, show_default=True,
                                help="Concurrent streams per level, e.g. 1,4,8 (a sweep).")]
RequestsOpt = Annotated[int, _opt("--requests", "-n", min=1, show_default=True,
                                  help="Requests per concurrency level.")]
PromptOpt = Annotated[str, _opt(callback=_length_range, show_default=True,
                                help="Prompt length N or LOW:HIGH, in words (about tokens).")]
OutputOpt = Annotated[str, _opt(callback=_length_range, show_default=True,
                                help="Output tokens N or LOW:HIGH (exact: ignore_eos).")]
PrefixOpt = Annotated[int, _opt(min=0, show_default=True,
                                help="Words shared by every prompt's start (prefix caches).")]
RateOpt = Annotated[float | None, _opt(
    help="Poisson arrivals at R requests/s (default: closed loop).")]
SeedOpt = Annotated[int, _opt(help="Seed of prompts, lengths and arrivals.", show_default=True)]
TemperatureOpt = Annotated[float, _opt(min=0.0, help="Sampling temperature.", show_default=True)]
TimeoutOpt = Annotated[float, _opt(min=0.1, help="Per-request timeout, seconds.",
                                   show_default=True)]
JsonOpt = Annotated[Path | None, _opt("--json", help="Also write the results as JSON here.")]
PerRequestOpt = Annotated[bool, _opt(help="Include every request's record in the JSON.")]
LabOpt = Annotated[bool, _opt("--lab", help="Run the scheduler lab (modelled times) instead.")]
ScenarioOpt = Annotated[list[str] | None, _opt(
    help="Lab scenario to run (repeatable; default: all).")]
LabRunsOpt = Annotated[int | None, _opt(min=0, help="Timed policy runs per lab scenario.")]


@app.command("bench")
def bench(
    config: ConfigOpt = None, url: UrlOpt = None, vs: VsOpt = None, model: ModelOpt = None,
    vs_model: VsModelOpt = None, api_key: ApiKeyOpt = None, vs_api_key: VsApiKeyOpt = None,
    concurrency: LevelsOpt = "1,4,8", requests: RequestsOpt = 16,
    prompt_tokens: PromptOpt = "64", output_tokens: OutputOpt = "64",
    shared_prefix: PrefixOpt = 0, rate: RateOpt = None, seed: SeedOpt = 0,
    temperature: TemperatureOpt = 0.0, timeout: TimeoutOpt = DEFAULT_TIMEOUT_S,
    json_path: JsonOpt = None, per_request: PerRequestOpt = False,
    lab: LabOpt = False, scenario: ScenarioOpt = None, lab_runs: LabRunsOpt = None,
) -> None:
    """Measure streaming completions: TTFT, inter-token latency, throughput, errors."""
    if lab:
        _run_lab(scenario, lab_runs, json_path)
        return
    if (config is None) == (url is None):
        raise _fail("give exactly one target: --config PATH or --url URL", EXIT_USAGE)
    spec = _make_spec(concurrency, requests, prompt_tokens, output_tokens, shared_prefix,
                      rate, seed, temperature)
    endpoints = [(config, url, model, api_key), (None, vs, vs_model, vs_api_key)]
    runs = _measure(spec, [e for e in endpoints if e[0] or e[1]], timeout)
    _report(spec, runs, json_path, per_request)


def _make_spec(concurrency: str, requests: int, prompt_tokens: str, output_tokens: str,
               shared_prefix: int, rate: float | None, seed: int,
               temperature: float) -> WorkloadSpec:
    try:
        return WorkloadSpec(
            concurrency=parse_concurrency(concurrency), num_requests=requests,
            prompt_words=parse_range(prompt_tokens, "--prompt-tokens"),
            output_tokens=parse_range(output_tokens, "--output-tokens"),
            shared_prefix_words=shared_prefix, rate=rate, seed=seed, temperature=temperature)
    except WorkloadError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


Endpoint = tuple[Path | None, str | None, str | None, str | None]
"""(config, url, model, api key) of one target."""


def _measure(spec: WorkloadSpec, endpoints: list[Endpoint], timeout_s: float) -> list[TargetRun]:
    """Start skippyd when a config is given, then run the workload on every endpoint."""
    try:
        with sigterm_exits(), contextlib.ExitStack() as stack:
            resolved = [_open_endpoint(stack, endpoint) for endpoint in endpoints]
            names = _names([url for url, _, _ in resolved], [e[0] for e in endpoints])
            return asyncio.run(_run(spec, names, resolved, timeout_s))
    except BenchError as exc:
        raise _fail(str(exc), EXIT_FAILED) from None


def _open_endpoint(stack: contextlib.ExitStack,
                   endpoint: Endpoint) -> tuple[str, str | None, str | None]:
    config, url, model, api_key = endpoint
    if config is None:
        assert url is not None
        return url, model, api_key
    from skippyd.config import ConfigError, load_config

    try:
        api_key = load_config(config).http.api_key
    except ConfigError as exc:
        raise _fail(f"invalid config {config}\n{exc}", EXIT_USAGE) from None
    stderr.print(f"starting skippyd serve --config {config} …")
    server = stack.enter_context(skippyd_process(str(config)))
    return server.url, model, api_key


def _names(urls: list[str], configs: list[Path | None]) -> list[str]:
    names = ["skippyd" if config else httpx.URL(url).netloc.decode() or url
             for url, config in zip(urls, configs, strict=True)]
    if len(names) == 2 and names[0] == names[1]:
        names[1] += " (vs)"
    return names


async def _run(spec: WorkloadSpec, names: list[str],
               resolved: list[tuple[str, str | None, str | None]],
               timeout_s: float) -> list[TargetRun]:
    async with make_client(max(spec.concurrency), timeout_s) as client:
        targets = [await resolve_target(client, name, url, model=model, api_key=key)
                   for name, (url, model, key) in zip(names, resolved, strict=True)]
        with RichProgress(stderr) as progress:
            return await run_benchmark(client, targets, spec, timeout_s=timeout_s,
                                       progress=progress)


def _report(spec: WorkloadSpec, runs: list[TargetRun], json_path: Path | None,
            per_request: bool) -> None:
    metrics = [[level_metrics(level) for level in run.levels] for run in runs]
    for run, levels in zip(runs, metrics, strict=True):
        for table in target_tables(run, levels):
            stdout.print(table)
        for line in error_lines(run, levels):
            stderr.print(f"[yellow]{escape(line)}[/]", highlight=False)
    if len(runs) == 2:
        stdout.print(comparison_table(runs[0], runs[1], comparison_rows(*metrics)))
    if json_path is not None:
        report = report_to_json(spec, runs, metrics, per_request=per_request)
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        stderr.print(f"wrote {json_path}")
    failed = [run.target.name for run, levels in zip(runs, metrics, strict=True)
              if not any(m.num_ok for m in levels)]
    if failed:
        raise _fail(f"every request failed on {', '.join(failed)}", EXIT_FAILED)


def _run_lab(scenarios: list[str] | None, lab_runs: int | None, json_path: Path | None) -> None:
    from skippyd.bench.lab import (
        DEFAULT_BENCH_RUNS,
        UnknownScenarioError,
        lab_rows_to_json,
        lab_table,
        run_lab,
    )

    runs = DEFAULT_BENCH_RUNS if lab_runs is None else lab_runs
    try:
        rows = run_lab(scenarios or None, bench_runs=runs)
    except UnknownScenarioError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    stdout.print(lab_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps(lab_rows_to_json(rows), indent=2) + "\n",
                             encoding="utf-8")
        stderr.print(f"wrote {json_path}")


# -- servers started for a run -----------------------------------------------------------
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


def skippyd_process(config_path: str, *, extra_args: Sequence[str] = (),
                    env: Mapping[str, str] | None = None) -> ServerProcess:
    """A ``skippyd serve`` of ``config_path`` on a free loopback port (``env`` adds
    environment variables)."""
    argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", config_path,
            "--listen", "127.0.0.1:0", *extra_args]
    return ServerProcess(argv, SKIPPYD_READY, name="skippyd", env=env)
