"""``skippyd bench``: a one-shot load benchmark of OpenAI-compatible endpoints.

It measures skippyd (started for the run from ``--config``) or any endpoint (``--url``),
optionally side by side with a second one (``--vs``), with streaming ``/v1/completions``
requests. ``--lab`` runs the scheduler lab instead (modelled times, no server).

A ``--config`` target runs as a :class:`~skippyd.bench.process.ServerProcess`, stopped
after the run (SIGTERM to the benchmark included). The load generator, httpx and the
report are imported when a benchmark runs, so ``skippyd --help`` does not pay for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from skippyd.bench.workload import (
    DEFAULT_TIMEOUT_S,
    WorkloadError,
    WorkloadSpec,
    parse_concurrency,
    parse_range,
)
from skippyd.exitcodes import ExitCode

if TYPE_CHECKING:
    from skippyd.bench.loadgen import TargetRun
    from skippyd.config import StageConfig

logger = logging.getLogger(__name__)

app = typer.Typer(add_completion=False)
# NOTE: a pipe gets 120 columns, not rich's default 80, so the tables stay readable in logs.
stdout = Console(width=None if Console().is_terminal else 120)
stderr = Console(stderr=True, soft_wrap=True)

def _fail(message: str, code: ExitCode) -> typer.Exit:
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


ConfigOpt = Annotated[list[Path] | None, _opt(
    "--config", help="Start skippyd with this stage config for the run, then stop it; "
    "repeat it with every stage's config to start a whole split pipeline.")]
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
    if (not config) == (url is None):
        raise _fail("give exactly one target: --config PATH (one per stage) or --url URL",
                    ExitCode.USAGE)
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
        raise _fail(str(exc), ExitCode.USAGE) from None


Endpoint = tuple[list[Path] | None, str | None, str | None, str | None]
"""(stage configs, url, model, api key) of one target."""


def _measure(spec: WorkloadSpec, endpoints: list[Endpoint], timeout_s: float) -> list[TargetRun]:
    """Start skippyd when a config is given, then run the workload on every endpoint."""
    from skippyd.bench.loadgen import BenchError
    from skippyd.bench.process import sigterm_exits

    try:
        with sigterm_exits(), contextlib.ExitStack() as stack:
            resolved = [_open_endpoint(stack, endpoint) for endpoint in endpoints]
            names = _names([url for url, _, _ in resolved], [e[0] for e in endpoints])
            return asyncio.run(_run(spec, names, resolved, timeout_s))
    except BenchError as exc:
        raise _fail(str(exc), ExitCode.FAILURE) from None


def _open_endpoint(stack: contextlib.ExitStack,
                   endpoint: Endpoint) -> tuple[str, str | None, str | None]:
    configs, url, model, api_key = endpoint
    if not configs:
        assert url is not None
        return url, model, api_key
    ordered = _pipeline_order(configs)
    head = ordered[0][1]
    if not head.is_first:
        raise _fail(f"no stage 0 among the configs (the first is stage index "
                    f"{head.stage.index}): give every stage's config", ExitCode.USAGE)
    from skippyd.bench.process import skippyd_pipeline, skippyd_process

    paths = [str(path) for path, _ in ordered]
    if len(paths) == 1:
        stderr.print(f"starting skippyd serve --config {escape(paths[0])} …")
        server = stack.enter_context(skippyd_process(paths[0]))
    else:
        stderr.print(f"starting a {len(paths)}-stage pipeline: {escape(', '.join(paths))} …")
        server = stack.enter_context(skippyd_pipeline(paths))
    return server.url, model, head.http.api_key if head.http is not None else None


def _pipeline_order(paths: list[Path]) -> list[tuple[Path, StageConfig]]:
    """Load the configs, in stage order; several must chain into one pipeline."""
    from skippyd.config import ConfigError, check_pipeline, load_config

    loaded = []
    for path in paths:
        try:
            loaded.append((path, load_config(path)))
        except ConfigError as exc:
            raise _fail(f"invalid config {path}\n{exc}", ExitCode.CONFIG) from None
    loaded.sort(key=lambda item: item[1].stage.index)
    if len(loaded) > 1:
        try:
            check_pipeline([config for _, config in loaded])
        except ConfigError as exc:
            raise _fail(f"the configs do not form one pipeline\n{exc}",
                        ExitCode.CONFIG) from None
    return loaded


def _names(urls: list[str], configs: list[list[Path] | None]) -> list[str]:
    import httpx

    names = [("skippyd" if len(config) == 1 else f"skippyd ({len(config)} stages)")
             if config else httpx.URL(url).netloc.decode() or url
             for url, config in zip(urls, configs, strict=True)]
    if len(names) == 2 and names[0] == names[1]:
        names[1] += " (vs)"
    return names


async def _run(spec: WorkloadSpec, names: list[str],
               resolved: list[tuple[str, str | None, str | None]],
               timeout_s: float) -> list[TargetRun]:
    from skippyd.bench.loadgen import make_client, resolve_target, run_benchmark
    from skippyd.bench.report import RichProgress

    async with make_client(max(spec.concurrency), timeout_s) as client:
        targets = [await resolve_target(client, name, url, model=model, api_key=key)
                   for name, (url, model, key) in zip(names, resolved, strict=True)]
        with RichProgress(stderr) as progress:
            return await run_benchmark(client, targets, spec, timeout_s=timeout_s,
                                       progress=progress)


def _report(spec: WorkloadSpec, runs: list[TargetRun], json_path: Path | None,
            per_request: bool) -> None:
    from skippyd.bench.report import print_report

    metrics = print_report(stdout, stderr, spec, runs, json_path, per_request=per_request)
    failed = [run.target.name for run, levels in zip(runs, metrics, strict=True)
              if not any(m.num_ok for m in levels)]
    if failed:
        raise _fail(f"every request failed on {', '.join(failed)}", ExitCode.FAILURE)


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
        raise _fail(str(exc), ExitCode.USAGE) from None
    stdout.print(lab_table(rows))
    if json_path is not None:
        json_path.write_text(json.dumps(lab_rows_to_json(rows), indent=2) + "\n",
                             encoding="utf-8")
        stderr.print(f"wrote {json_path}")
