"""Prefix cache: skippyd with the cache against skippyd with ``kv_cache.mode = "disabled"``.

Starts two skippyd servers on loopback with the embedded SmolLM2-135M model, the same
lanes, context and thread count, then sends each the same burst: 8 concurrent streaming
completions sharing a 1 024-word system prompt (about one token per word) followed by
distinct 32-word questions, 32 output tokens each (``ignore_eos`` makes the lengths
exact). Targets: at least 3x the aggregate output throughput and at least 5x lower
median TTFT with the cache. The servers are measured one after the other, in the same run.

Usage::

    python bench/prefix_cache.py [--concurrency 8] [--json out.json]
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
from skippyd.bench.process import skippyd_process
from skippyd.bench.report import LevelMetrics, RichProgress, print_report
from skippyd.bench.workload import IntRange, WorkloadSpec
from skippyd.config import default_model_path

logger = logging.getLogger(__name__)

#: Minimum ratios cache / no cache: output throughput, and no-cache / cache median TTFT.
MIN_THROUGHPUT_RATIO = 3.0
MIN_TTFT_RATIO = 5.0

console = Console(width=None if Console().is_terminal else 120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="streams (and requests)")
    parser.add_argument("--system-tokens", type=int, default=1024, help="shared words (~tokens)")
    parser.add_argument("--question-tokens", type=int, default=32, help="distinct words per request")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def skippyd_config(name: str, model: Path, args: argparse.Namespace, mode: str) -> str:
    """A stage config whose pool holds every request's whole prompt at once."""
    per_request = args.system_tokens + args.question_tokens + args.output_tokens + 64
    ctx_size = (args.concurrency * per_request + 255) // 256 * 256
    return (f'[stage]\nid = "{name}-{os.getpid()}"\nmodel_path = "{model}"\n\n'
            f"[runtime]\nctx_size = {ctx_size}\nlane_count = {args.concurrency}\n"
            f"threads = {args.threads}\nthreads_batch = {args.threads}\n"
            f"queue_capacity = {max(8, args.concurrency)}\n\n"
            f'[kv_cache]\nmode = "{mode}"\n')


def verdicts(cached: LevelMetrics, cold: LevelMetrics) -> list[str]:
    """The two targets, met or missed, with the numbers."""
    throughput = cached.output_tok_s / cold.output_tok_s if cold.output_tok_s else 0.0
    ttft_cached, ttft_cold = cached.ttft_ms.p50, cold.ttft_ms.p50
    ttft = ttft_cold / ttft_cached if ttft_cached and ttft_cold else 0.0
    lines = []
    for met, text in (
        (throughput >= MIN_THROUGHPUT_RATIO,
         f"aggregate output throughput {throughput:.2f}x (target >= {MIN_THROUGHPUT_RATIO}x)"),
        (ttft >= MIN_TTFT_RATIO,
         f"median TTFT {ttft_cached or 0:.0f} ms vs {ttft_cold or 0:.0f} ms: {ttft:.2f}x lower"
         f" (target >= {MIN_TTFT_RATIO}x)"),
    ):
        lines.append(f"[{'green' if met else 'red'}]{'MET' if met else 'MISSED'}[/] {text}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model_path()
    prompt_words = args.system_tokens + args.question_tokens
    spec = WorkloadSpec(concurrency=(args.concurrency,), num_requests=args.concurrency,
                        prompt_words=IntRange(prompt_words, prompt_words),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens),
                        shared_prefix_words=args.system_tokens, seed=args.seed)
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        urls = []
        for name, mode in (("cache", "auto"), ("no-cache", "disabled")):
            config = Path(workdir) / f"{name}.toml"
            config.write_text(skippyd_config(name, model, args, mode))
            urls.append((f"skippyd {name}", stack.enter_context(skippyd_process(str(config))).url))
        with RichProgress(Console(stderr=True)) as progress:
            runs = asyncio.run(measure_urls(spec, urls, progress=progress))
    # NOTE: both servers share the machine with anything else running; a load average
    # well above the thread count means the figures are noisy.
    console.print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}"
                  f" on {os.cpu_count()} CPUs")
    metrics = print_report(console, Console(stderr=True), spec, runs, args.json)
    for line in verdicts(metrics[0][0], metrics[1][0]):
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
