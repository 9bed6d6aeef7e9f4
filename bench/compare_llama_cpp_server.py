"""Headline comparison: skippyd against llama-cpp-python's own server, same run, same model.

Starts both servers on loopback with the embedded SmolLM2-135M model and the same thread
count, then measures streaming completions at 1, 4 and 8 concurrent clients with the
``skippyd bench`` load generator: each level runs on skippyd, then on llama_cpp.server,
with the same unique prompts (about 60 tokens) and 64 output tokens per request
(``ignore_eos``/``min_tokens`` make the lengths exact on both).

llama_cpp.server needs its ``server`` extra: ``pip install 'llama-cpp-python[server]'``.
By default it cancels the stream in flight whenever a new request arrives, so it runs
with ``--interrupt_requests False`` and serves concurrent clients one after another.

Usage::

    python bench/compare_llama_cpp_server.py [--requests 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from skippyd.bench.loadgen import measure_urls
from skippyd.bench.process import ServerProcess, free_port, sigterm_exits, skippyd_process
from skippyd.bench.report import LevelMetrics, RichProgress, print_report
from skippyd.bench.workload import IntRange, WorkloadSpec, parse_concurrency
from skippyd.config import default_model_path

logger = logging.getLogger(__name__)

LLAMA_READY = r"Uvicorn running on (?P<url>http://\S+)"
#: (concurrency, minimum tok/s ratio skippyd / llama_cpp.server, TTFT p50 must be lower).
TARGETS = ((1, 0.9, False), (8, 1.8, True))

console = Console(width=None if Console().is_terminal else 120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", "-c", default="1,4,8", help="levels (default 1,4,8)")
    parser.add_argument("--requests", "-n", type=int, default=16, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=60, help="prompt words (~tokens)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both servers")
    parser.add_argument("--lanes", type=int, default=8, help="skippyd lanes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--omp-passive", action="store_true",
                        help="run both servers with OMP_WAIT_POLICY=PASSIVE")
    return parser.parse_args(argv)


def skippyd_config(model: Path, threads: int, lanes: int, workdir: Path) -> str:
    """The stage config skippyd serves with in this comparison."""
    return (f'[stage]\nid = "bench"\nmodel_path = "{model}"\n\n'
            f"[runtime]\nctx_size = 4096\nlane_count = {lanes}\n"
            f"threads = {threads}\nthreads_batch = {threads}\n\n"
            f'[control]\nsocket = "{workdir / "control.sock"}"\n\n'
            '[http]\nlisten = "127.0.0.1:0"\n')


def llama_cpp_server(model: Path, threads: int, env: dict[str, str]) -> ServerProcess:
    """``python -m llama_cpp.server`` on the same model and thread count."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", "2048", "--interrupt_requests", "False"]
    return ServerProcess(argv, LLAMA_READY, name="llama_cpp.server", env=env)


def verdicts(metrics: list[list[LevelMetrics]]) -> list[str]:
    """One line per headline target: met or missed, with the numbers."""
    by_level = {m.concurrency: (m, o) for m, o in zip(metrics[0], metrics[1], strict=True)}
    lines = []
    for concurrency, min_ratio, ttft_lower in TARGETS:
        if concurrency not in by_level:
            continue
        ours, theirs = by_level[concurrency]
        tok_ratio = ours.output_tok_s / theirs.output_tok_s if theirs.output_tok_s else 0.0
        met = tok_ratio >= min_ratio
        line = f"{concurrency} streams: tok/s ratio {tok_ratio:.2f}x (target >= {min_ratio}x)"
        if ttft_lower:
            lower = (ours.ttft_ms.p50 or float("inf")) < (theirs.ttft_ms.p50 or float("inf"))
            met = met and lower
            line += (f", TTFT p50 {ours.ttft_ms.p50:.0f} ms vs {theirs.ttft_ms.p50:.0f} ms"
                     " (target: lower)")
        lines.append(f"[{'green' if met else 'red'}]{'MET' if met else 'MISSED'}[/] {line}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model_path()
    spec = WorkloadSpec(concurrency=parse_concurrency(args.concurrency),
                        num_requests=args.requests,
                        prompt_words=IntRange(args.prompt_tokens, args.prompt_tokens),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens),
                        seed=args.seed)
    with sigterm_exits(), tempfile.TemporaryDirectory() as workdir, \
            contextlib.ExitStack() as stack:
        config = Path(workdir) / "skippyd.toml"
        config.write_text(skippyd_config(model, args.threads, args.lanes, Path(workdir)))
        console.print(f"starting skippyd and llama_cpp.server on {model.name} …")
        # NOTE: OpenMP threads spin between graph nodes by default; when other processes
        # compete for the CPUs, PASSIVE makes them sleep instead. Same for both servers.
        env = {"OMP_WAIT_POLICY": "PASSIVE"} if args.omp_passive else {}
        ours = stack.enter_context(skippyd_process(str(config), env=env))
        theirs = stack.enter_context(llama_cpp_server(model, args.threads, env))
        with RichProgress(Console(stderr=True)) as progress:
            runs = asyncio.run(measure_urls(spec, [("skippyd", ours.url),
                                                   ("llama_cpp.server", theirs.url)],
                                            progress=progress))
    # NOTE: both servers share the machine with anything else running; a load average
    # well above the thread count means the figures are noisy.
    console.print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}"
                  f" on {os.cpu_count()} CPUs")
    metrics = print_report(console, Console(stderr=True), spec, runs, args.json)
    for line in verdicts(metrics):
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
