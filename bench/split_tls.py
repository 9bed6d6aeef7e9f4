"""What TLS on the stage links costs a split pipeline: tok/s with ``link.tls`` on and off.

Starts two 2-stage chains of the same model side by side, one in plaintext (HMAC
handshake only) and one with every link inside TLS, each link of both through a link
shaper (``skippyd.bench.shaper``) with the same round-trip time. For each RTT and each
number of streams it runs the same requests on both chains, one after the other, the
order alternating from round to round, and compares the two in each round. Only one
chain works at a time; the idle one only answers its link probes.

Beside tok/s it gives the CPU time the stage processes spent per generated token (all
their threads: llama.cpp, the link, the HTTP side), which is where TLS's own work shows,
less blurred by the scheduling of two cores than tok/s.

The verdict per RTT and stream count: the median over the rounds of TLS tok/s divided
by plaintext tok/s must be at least ``--target`` (0.97: TLS costs at most 3 %), and no
request may fail.

Usage::

    python bench/split_tls.py [--model PATH] [--rtt-ms 0,5] [-c 1,8] [--rounds 12] \\
        [--requests 6,16] [--output-tokens 48] [--json out.json]

Exit status 0 when every cell met the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from split_links import Pipeline

from skippyd.bench.loadgen import ProgressHook, make_client, resolve_target, run_level, warm_up
from skippyd.bench.models import add_model_option, model_layers, model_path
from skippyd.bench.process import thread_cpu_seconds, wait_pipeline_connected
from skippyd.bench.report import level_metrics
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level

logger = logging.getLogger(__name__)

VARIANTS = ("plaintext", "tls")
console = Console(width=None if Console().is_terminal else 120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numbers = lambda kind: lambda text: [kind(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--rtt-ms", type=numbers(float), default=[0.0, 5.0])
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="bandwidth of every shaped link")
    parser.add_argument("--concurrency", "-c", type=numbers(int), default=[1, 8])
    parser.add_argument("--requests", "-n", type=numbers(int), default=None,
                        help="requests per measurement, one per -c value "
                             "(default: 6 at one stream, two per stream above)")
    parser.add_argument("--rounds", type=int, default=12,
                        help="measurements of each variant per cell (the order alternates)")
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.97,
                        help="least TLS/plaintext tok/s ratio that passes")
    parser.add_argument("--json", type=Path, default=None)
    add_model_option(parser)
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = [6 if c == 1 else 2 * c for c in args.concurrency]
    if len(args.requests) != len(args.concurrency):
        parser.error("--requests: give one count per --concurrency value")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if max(args.concurrency) > args.lanes:
        parser.error("--lanes: at least the largest --concurrency")
    args.n_layer = model_layers(model_path(args))
    args.activation_dtype = "f32"
    return args


async def measure(chains: dict[str, Pipeline], urls: dict[str, str],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (RTT, streams, round, variant) measurement, in the order taken."""
    words, tokens = (IntRange(args.prompt_tokens, args.prompt_tokens),
                     IntRange(args.output_tokens, args.output_tokens))
    specs = [WorkloadSpec(concurrency=(c,), num_requests=n, prompt_words=words,
                          output_tokens=tokens)
             for c, n in zip(args.concurrency, args.requests, strict=True)]
    rows: list[dict[str, Any]] = []
    async with make_client(max(args.concurrency)) as client:
        for rtt in args.rtt_ms:
            for chain in chains.values():
                chain.shape(rtt, args.rate_mbit)
            targets = {}
            for name in VARIANTS:
                wait_pipeline_connected(urls[name])
                target = await resolve_target(client, name, urls[name])
                targets[name] = await warm_up(client, target, specs[0], 300.0)
            for spec in specs:
                (concurrency,) = spec.concurrency
                requests = build_level(spec, 0)  # the same requests for both, every round
                for round_index in range(args.rounds):
                    order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
                    for name in order:
                        cpu_before = stage_cpu_s(chains[name])
                        level = await run_level(client, targets[name], requests, concurrency,
                                                temperature=0.0, timeout_s=300.0,
                                                on_done=ProgressHook().request_done)
                        cpu_s = stage_cpu_s(chains[name]) - cpu_before
                        metrics = level_metrics(level)
                        errors = sum(metrics.errors.values())
                        cpu_ms = cpu_s / max(metrics.output_tokens, 1) * 1000.0
                        rows.append({"variant": name, "rtt_ms": rtt, "streams": concurrency,
                                     "round": round_index,
                                     "output_tok_s": metrics.output_tok_s,
                                     "output_tokens": metrics.output_tokens,
                                     "cpu_ms_per_token": cpu_ms,
                                     "errors": errors, "error_kinds": metrics.errors})
                        console.print(f"RTT {rtt:g} ms, {concurrency} stream(s), round "
                                      f"{round_index + 1}, {name}: "
                                      f"{metrics.output_tok_s:.2f} tok/s, {cpu_ms:.2f} CPU "
                                      f"ms/token, errors {errors}")
    for chain in chains.values():
        chain.unshape()
    return rows


def stage_cpu_s(chain: Pipeline) -> float:
    """CPU seconds every thread of the chain's stage processes has used so far (the
    shapers, stand-ins for the network, are left out)."""
    return sum(sum(thread_cpu_seconds(proc.pid).values()) for proc in chain.stages
               if proc.pid is not None)


def summarise(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per (RTT, streams): median tok/s of each variant, the median of the per-round
    TLS/plaintext ratios, and the verdict."""
    out = []
    for key in dict.fromkeys((r["rtt_ms"], r["streams"]) for r in rows):
        mine = [r for r in rows if (r["rtt_ms"], r["streams"]) == key]
        by_round: dict[int, dict[str, float]] = {}
        for r in mine:
            by_round.setdefault(r["round"], {})[r["variant"]] = r["output_tok_s"]
        ratios = [v["tls"] / v["plaintext"] for v in by_round.values()
                  if v.get("plaintext") and "tls" in v]
        errors = sum(r["errors"] for r in mine)
        ratio = statistics.median(ratios) if ratios else 0.0
        out.append({
            "rtt_ms": key[0], "streams": key[1], "rounds": len(ratios),
            "plaintext_tok_s": statistics.median(r["output_tok_s"] for r in mine
                                                 if r["variant"] == "plaintext"),
            "tls_tok_s": statistics.median(r["output_tok_s"] for r in mine
                                           if r["variant"] == "tls"),
            "plaintext_cpu_ms": statistics.median(r["cpu_ms_per_token"] for r in mine
                                                  if r["variant"] == "plaintext"),
            "tls_cpu_ms": statistics.median(r["cpu_ms_per_token"] for r in mine
                                            if r["variant"] == "tls"),
            "ratio": ratio, "ratio_min": min(ratios, default=0.0),
            "ratio_max": max(ratios, default=0.0), "errors": errors,
            "met": errors == 0 and ratio >= target,
        })
    return out


def table(summary: list[dict[str, Any]], model: str, target: float) -> Table:
    out = Table(title=f"TLS vs plaintext stage links, {model}, 2 stages "
                      f"(median of rounds; target TLS/plaintext >= {target:g})")
    for column in ("RTT", "streams", "plaintext tok/s", "TLS tok/s", "TLS/plaintext",
                   "range", "CPU ms/token", "errors", "verdict"):
        out.add_column(column, justify="right")
    for row in summary:
        out.add_row(f"{row['rtt_ms']:g} ms", str(row["streams"]),
                    f"{row['plaintext_tok_s']:.2f}", f"{row['tls_tok_s']:.2f}",
                    f"{row['ratio']:.3f}", f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}",
                    f"{row['plaintext_cpu_ms']:.2f} / {row['tls_cpu_ms']:.2f}",
                    str(row["errors"]), "[green]MET[/]" if row["met"] else "[red]NOT MET[/]")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = model_path(args).name
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        chains: dict[str, Pipeline] = {}
        urls: dict[str, str] = {}
        for name in VARIANTS:
            workdir = Path(tmp) / name
            workdir.mkdir()
            chains[name] = Pipeline(workdir, 2, args, tls=name == "tls")
            stack.callback(chains[name].unshape)
            console.print(f"starting the {name} chain of {model} …")
            urls[name] = chains[name].start(stack)
        rows = asyncio.run(measure(chains, urls, args))
    summary = summarise(rows, args.target)
    console.print(table(summary, model, args.target))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": model, "args": {
            k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)},
            "summary": summary, "rows": rows}, indent=2, default=str) + "\n")
    return 0 if all(row["met"] for row in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
