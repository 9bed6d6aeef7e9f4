"""Split serving against unsplit serving: same model, same total threads, same run.

Starts the embedded SmolLM2-135M as one process (``--threads`` llama.cpp threads), once
more on one stage's threads (the 1-stream anchor), and as a 2-stage chain (layers 0-17
and 17-30, ``--threads / 2`` threads each) on loopback,
then runs the ``skippyd bench`` workload (streaming completions, unique prompts, exact
output lengths) at each concurrency level, alternating the targets for ``--rounds``
rounds. For the chain it also reads every stage's STATUS over the stage link before and
after each level: the busy fraction (time in llama.cpp / wall time) of each stage and
the link bytes per generated token.

Usage::

    python bench/split_vs_unsplit.py [--threads 2] [-c 1,8] [-n 16] [--rounds 2] [--json out.json]

On a machine other work shares, a two-thread llama.cpp server degrades far more than two
one-thread stages (its threads spin at barriers while the other is descheduled), which
flatters the chain. ``--pin 1 --unsplit-threads 1`` puts every server on one CPU with
one thread each: the ratio then shows what splitting costs on equal CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from skippyd.bench.chain_config import LocalChain, write_config
from skippyd.bench.loadgen import (
    ProgressHook,
    make_client,
    resolve_target,
    run_level,
    warm_up,
)
from skippyd.bench.models import (
    add_model_option,
    layer_bounds,
    model_keys,
    model_layers,
    model_path,
)
from skippyd.bench.process import SKIPPYD_READY, STAGE_READY, ServerProcess
from skippyd.bench.report import level_metrics
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level, parse_concurrency
from skippyd.link.dialer import query_status

logger = logging.getLogger(__name__)

SECRET = "split-bench-secret-0123456789abcdef"
#: Targets: the chain at 8 streams reaches 0.9x the unsplit tok/s (same total threads),
#: and at 1 stream 0.9x an unsplit server on one stage's threads.
TARGETS = ((8, "unsplit", 0.9), (1, "unsplit-1t", 0.9))
#: The unsplit server on one stage's threads; measured at 1 stream only.
ONE_THREAD = "unsplit-1t"
console = Console(width=None if Console().is_terminal else 120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", "-c", default="1,8", help="levels (default 1,8)")
    parser.add_argument("--requests", "-n", type=int, default=16, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=60, help="prompt words (~tokens)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2,
                        help="total llama.cpp threads (the chain gives each stage half)")
    parser.add_argument("--unsplit-threads", type=int, default=None,
                        help="threads of the unsplit server (default: --threads)")
    parser.add_argument("--stage-threads", type=int, default=None,
                        help="threads of each stage (default: half of --threads)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="run every server with OMP_WAIT_POLICY=PASSIVE (idle llama.cpp "
                             "threads sleep instead of spinning)")
    parser.add_argument("--pin", default=None, metavar="CPUS",
                        help="run every server under `taskset -c CPUS` (e.g. 1): measures the "
                             "cost of splitting on equal CPU when the machine is shared")
    parser.add_argument("--lanes", type=int, default=8)
    add_model_option(parser)
    parser.add_argument("--split-at", type=int, default=None,
                        help="first layer of stage 1 (default: 17 of 30 layers, scaled to the "
                             "model's depth; the final stage also computes the output head, "
                             "about eight of SmolLM2's layers' worth at decode)")
    parser.add_argument("--decode-groups", type=int, default=None,
                        help="runtime.pipeline_decode_groups of the chain (default: one per "
                             "stage plus one)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating repetitions")
    parser.add_argument("--only-split", action="store_true",
                        help="measure only the chain (its busy fractions and timeline)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.n_layer = model_layers(model_path(args))
    if args.split_at is None:
        args.split_at = layer_bounds(args.n_layer, 2)[1]
    if not 0 < args.split_at < args.n_layer:
        parser.error(f"--split-at: must be within 1..{args.n_layer - 1}")
    return args


def _runtime(workdir: Path, threads: int, lanes: int, **extra: Any) -> dict[str, Any]:
    return {"ctx_size": 4096, "lane_count": lanes, "threads": threads,
            "threads_batch": threads, "slice_cache_dir": str(workdir / "slices"), **extra}


def start_servers(workdir: Path, args: argparse.Namespace,
                  stack: contextlib.ExitStack) -> tuple[dict[str, str], list[int]]:
    """The 2-stage chain and the unsplit servers; returns (target urls, link ports).

    Besides the unsplit server on ``--threads``, one on a stage's threads is the anchor
    at 1 stream: one stream cannot pipeline, so it shows the link's cost alone.
    """
    half = args.stage_threads or max(1, args.threads // 2)
    chain = LocalChain.on_free_ports(workdir, (0, args.split_at, args.n_layer), SECRET)
    groups = {"pipeline_decode_groups": args.decode_groups} if args.decode_groups else {}
    stage1 = chain.write(1, stage=model_keys(args), runtime=_runtime(workdir, half, args.lanes))
    stage0 = chain.write(0, stage=model_keys(args),
                         runtime=_runtime(workdir, half, args.lanes, **groups))
    env = {"OMP_WAIT_POLICY": "PASSIVE"} if args.omp_passive else None
    stack.enter_context(serve(stage1, STAGE_READY, "stage-1", args.pin, env))
    head = stack.enter_context(serve(stage0, SKIPPYD_READY, "stage-0", args.pin, env))
    urls = {"split": head.url}
    if not args.only_split:
        for name, threads in (("unsplit", args.unsplit_threads or args.threads),
                              (ONE_THREAD, half)):
            single = write_config(workdir / f"{name}.toml", {
                "stage": {"id": name, **model_keys(args)},
                "runtime": _runtime(workdir, threads, args.lanes),
                "control": {"socket": str(workdir / f"{name}.sock")},
                "http": {"listen": "127.0.0.1:0"}})
            urls[name] = stack.enter_context(
                serve(single, SKIPPYD_READY, name, args.pin, env)).url
    deadline = time.monotonic() + 60
    while httpx.get(head.url.removesuffix("/v1") + "/health").json()["status"] != "ok":
        if time.monotonic() > deadline:
            raise RuntimeError("the chain did not connect:\n" + head.log_tail())
        time.sleep(0.1)  # stage 0 dials stage 1 with backoff; poll its health
    return urls, list(chain.link_ports)


def serve(config: Path, ready: str, name: str, cpus: str | None,
          env: dict[str, str] | None) -> ServerProcess:
    """``skippyd serve`` of ``config``, under ``taskset -c cpus`` when asked."""
    argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", str(config)]
    return ServerProcess((["taskset", "-c", cpus] if cpus else []) + argv, ready, name=name,
                         env=env)


def chain_status(ports: list[int]) -> list[dict[str, Any]]:
    return [query_status(("127.0.0.1", port), SECRET.encode()) for port in ports]


def chain_figures(before: list[dict], after: list[dict], tokens: int) -> dict[str, Any]:
    """Busy fraction per stage and link bytes per generated token over one level."""
    busy = []
    for old, new in zip(before, after, strict=True):
        wall = new["uptime_s"] - old["uptime_s"]
        busy.append((new["busy_s"] - old["busy_s"]) / wall if wall > 0 else 0.0)
    link = [after[0]["chain"][k] - before[0]["chain"][k] for k in ("bytes_out", "bytes_in")]
    hits = after[0]["lookahead_hits"] - before[0]["lookahead_hits"]
    steps = after[0]["lookahead_steps"] - before[0]["lookahead_steps"]
    return {"busy": busy, "bytes_per_token": sum(link) / max(tokens, 1),
            "bytes_down_per_token": link[0] / max(tokens, 1),
            "lookahead_steps": steps, "lookahead_hits": hits,
            "timeline_ms": [batch_timeline(old, new) for old, new in
                            zip(before, after, strict=True)]}


def batch_timeline(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """One stage's average milliseconds per batch in each phase over a level, and the
    batches per second it finished (``idle`` is what the phases leave of the wall time)."""
    old, new = before.get("timeline", {}), after.get("timeline", {})
    batches = new.get("batches", 0) - old.get("batches", 0)
    wall = after["uptime_s"] - before["uptime_s"]
    if batches <= 0 or wall <= 0:
        return {}
    phases = {key.removesuffix("_s"): (new[key] - old[key]) * 1000.0 / batches
              for key in new if key.endswith("_s")}
    phases["batches_per_s"] = batches / wall
    phases["wall"] = wall * 1000.0 / batches
    return phases


async def measure(args: argparse.Namespace, urls: dict[str, str],
                  ports: list[int]) -> list[dict[str, Any]]:
    levels = parse_concurrency(args.concurrency)
    spec = WorkloadSpec(concurrency=levels, num_requests=args.requests,
                        prompt_words=IntRange(args.prompt_tokens, args.prompt_tokens),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens))
    rows = []
    async with make_client(max(levels)) as client:
        targets = {name: await warm_up(client, await resolve_target(client, name, url), spec,
                                       300.0) for name, url in urls.items()}
        for index, concurrency in enumerate(levels):
            for round_ in range(args.rounds):
                # Fresh prompts every round, the same for both targets within a round.
                requests = build_level(spec, index + round_ * len(levels))
                order = [name for name in targets if name != ONE_THREAD or concurrency == 1]
                for name in (order if round_ % 2 == 0 else reversed(order)):
                    before = chain_status(ports) if name == "split" else None
                    level = await run_level(client, targets[name], requests, concurrency,
                                            temperature=0.0, timeout_s=300.0,
                                            on_done=ProgressHook().request_done)
                    metrics = level_metrics(level)
                    row = {"target": name, "concurrency": concurrency, "round": round_,
                           "output_tok_s": metrics.output_tok_s, "errors": metrics.errors,
                           "ttft_p50_ms": metrics.ttft_ms.p50}
                    if before is not None:
                        row.update(chain_figures(before, chain_status(ports),
                                                 metrics.output_tokens))
                    console.print(f"c={concurrency} round {round_} {name}: "
                                  f"{metrics.output_tok_s:.1f} tok/s")
                    rows.append(row)
    return rows


def _median_tok_s(rows: list[dict[str, Any]], streams: int, target: str) -> float | None:
    values = [r["output_tok_s"] for r in rows
              if r["concurrency"] == streams and r["target"] == target]
    return median(values) if values else None


def _ratio(rows: list[dict[str, Any]], streams: int, anchor: str) -> float | None:
    split, base = _median_tok_s(rows, streams, "split"), _median_tok_s(rows, streams, anchor)
    return split / base if split is not None and base else None


def summary(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="2-stage chain vs unsplit (median over rounds)")
    for column in ("streams", "unsplit tok/s", "1-thread tok/s", "split tok/s", "ratio",
                   "vs 1 thread", "busy stage 0", "busy stage 1", "link B/token",
                   "look-ahead hits"):
        table.add_column(column, justify="right")
    for concurrency in sorted({r["concurrency"] for r in rows}):
        split_rows = [r for r in rows if r["concurrency"] == concurrency
                      and r["target"] == "split"]
        busy = [median(r["busy"][i] for r in split_rows) for i in range(2)]
        bpt = median(r["bytes_per_token"] for r in split_rows)
        hits = sum(r["lookahead_hits"] for r in split_rows)
        steps = sum(r["lookahead_steps"] for r in split_rows)
        figures = [_median_tok_s(rows, concurrency, t) for t in ("unsplit", ONE_THREAD, "split")]
        ratios = [_ratio(rows, concurrency, anchor) for anchor in ("unsplit", ONE_THREAD)]
        table.add_row(str(concurrency), *("-" if f is None else f"{f:.1f}" for f in figures),
                      *("-" if r is None else f"{r:.2f}x" for r in ratios),
                      f"{busy[0]:.0%}", f"{busy[1]:.0%}", f"{bpt:.0f}", f"{hits}/{steps}")
    return table


def timeline_table(rows: list[dict[str, Any]]) -> Table:
    """Per stage and level: milliseconds per batch in each phase (medians over rounds)."""
    table = Table(title="where a batch's time goes, per stage (ms per batch, median over rounds)")
    phases = ("wall", "compute", "runtime", "encode", "send", "wait", "reply")
    for column in ("streams", "stage", "batches/s", *phases):
        table.add_column(column, justify="right")
    for concurrency in sorted({r["concurrency"] for r in rows}):
        split_rows = [r for r in rows if r["concurrency"] == concurrency and "timeline_ms" in r]
        if not split_rows:
            continue
        for stage in range(len(split_rows[0]["timeline_ms"])):
            lines = [r["timeline_ms"][stage] for r in split_rows if r["timeline_ms"][stage]]
            if not lines:
                continue
            table.add_row(str(concurrency), str(stage),
                          f"{median(line['batches_per_s'] for line in lines):.1f}",
                          *(f"{median(line.get(p, 0.0) for line in lines):.2f}"
                            for p in phases))
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        console.print("starting the unsplit server and the 2-stage chain …")
        urls, ports = start_servers(Path(tmp), args, stack)
        rows = asyncio.run(measure(args, urls, ports))
    console.print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on "
                  f"{os.cpu_count()} CPUs (other load makes the figures noisy)")
    console.print(summary(rows))
    console.print(timeline_table(rows))
    for streams, anchor, target in TARGETS:
        ratio = _ratio(rows, streams, anchor)
        if ratio is not None:
            met = ratio >= target
            console.print(f"[{'green' if met else 'red'}]{'MET' if met else 'MISSED'}[/] "
                          f"{streams} stream(s): split/{anchor} {ratio:.2f}x "
                          f"(target >= {target}x)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
