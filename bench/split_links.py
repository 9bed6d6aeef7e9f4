"""Split serving over links with real latency and bandwidth: 2- and 3-stage chains.

Starts SmolLM2 as a chain of ``--stages`` processes (one llama.cpp thread each) whose
every link, the return path from the final stage to stage 0 included, runs through a
link shaper (``skippyd.bench.shaper``, one process per link). For each bandwidth and
round-trip time it restarts the shapers with that shape, waits for stage 0 to
reconnect, and runs the ``skippyd bench`` workload at ``-c`` streams: output tok/s,
TTFT p50 and the link bytes per generated token. Each chain's figures are also given
as a ratio to its own 0 ms figure at the same bandwidth.

Usage::

    python bench/split_links.py [--stages 2,3] [--rtt-ms 0,1,5,20] \\
        [--rate-mbit 1000,100] [-c 8] [-n 16] [--activation-dtype f32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from skippyd.bench.chain_config import LocalChain
from skippyd.bench.loadgen import (
    ProgressHook,
    make_client,
    resolve_target,
    run_level,
    warm_up,
)
from skippyd.bench.models import (
    CUT_SHARES,
    add_model_option,
    layer_bounds,
    model_keys,
    model_layers,
    model_path,
)
from skippyd.bench.process import (
    SKIPPYD_READY,
    STAGE_READY,
    ServerProcess,
    wait_pipeline_connected,
)
from skippyd.bench.report import level_metrics
from skippyd.bench.shaper import READY_LINE
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level
from skippyd.link.dialer import query_status
from skippyd.link.keys import write_pipeline_keys
from skippyd.link.tls import LinkTls, TlsFiles

logger = logging.getLogger(__name__)

SECRET = "split-links-bench-secret-0123456789"
#: Target: at this RTT, 8 streams keep at least this share of the 0 ms figure.
TARGET = (5.0, 0.8)
console = Console(width=None if Console().is_terminal else 120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numbers = lambda kind: lambda text: [kind(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--stages", type=numbers(int), default=[2, 3])
    parser.add_argument("--rtt-ms", type=numbers(float), default=[0.0, 1.0, 5.0, 20.0])
    parser.add_argument("--rate-mbit", type=numbers(float), default=[1000.0, 100.0])
    parser.add_argument("--concurrency", "-c", type=int, default=8)
    parser.add_argument("--requests", "-n", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--activation-dtype", choices=("f32", "f16"), default="f32")
    parser.add_argument("--json", type=Path, default=None)
    add_model_option(parser)
    args = parser.parse_args(argv)
    if any(n not in CUT_SHARES for n in args.stages):
        parser.error(f"--stages: each must be one of {sorted(CUT_SHARES)}")
    args.n_layer = model_layers(model_path(args))
    return args


class Pipeline:
    """A chain whose links all go through shaper ports (restarted per shape).

    ``tls``: every link runs TLS (``link.tls``), keys made in ``workdir/tls``.
    """

    def __init__(self, workdir: Path, num_stages: int, args: argparse.Namespace, *,
                 tls: bool = False) -> None:
        self.workdir = workdir
        self.args = args
        keys = workdir / "tls" if tls else None
        self.layout = LocalChain.on_free_ports(workdir, layer_bounds(args.n_layer, num_stages),
                                               SECRET, shaped=True, tls_keys=keys)
        self.shapers: list[ServerProcess] = []
        self.stages: list[ServerProcess] = []
        """The stage processes, once started (the final stage first)."""
        self.monitor: LinkTls | None = None
        if keys is not None:
            write_pipeline_keys(keys, [*(f"stage-{i}" for i in range(num_stages)), "monitor"])
            self.monitor = LinkTls(TlsFiles(keys / "ca.crt", keys / "monitor.crt",
                                            keys / "monitor.key"), "monitor")

    def config(self, i: int) -> Path:
        return self.layout.write(
            i, stage=model_keys(self.args),
            runtime={"ctx_size": 4096, "lane_count": self.args.lanes, "threads": 1,
                     "threads_batch": 1, "slice_cache_dir": str(self.workdir.parent / "slices")},
            link={"activation_dtype": self.args.activation_dtype})

    def start(self, stack: contextlib.ExitStack) -> str:
        """Start every stage (last first); returns stage 0's API URL."""
        url = ""
        for i in reversed(range(self.layout.num_stages)):
            argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", str(self.config(i))]
            proc = stack.enter_context(ServerProcess(
                argv, SKIPPYD_READY if i == 0 else STAGE_READY, name=f"stage-{i}"))
            self.stages.append(proc)
            url = proc.url or url
        return url

    def shape(self, rtt_ms: float, rate_mbit: float) -> None:
        """(Re)start every shaper with this shape."""
        self.unshape()
        for port, target in self.layout.shaper_routes():
            argv = [sys.executable, "-m", "skippyd.bench.shaper", "--listen",
                    f"127.0.0.1:{port}", "--target", f"127.0.0.1:{target}",
                    "--rtt-ms", str(rtt_ms), "--rate-mbit", str(rate_mbit)]
            self.shapers.append(ServerProcess(argv, READY_LINE, name=f"shaper-{port}").start())

    def unshape(self) -> None:
        while self.shapers:
            self.shapers.pop().stop()

    def status(self) -> dict[str, Any]:
        return query_status(("127.0.0.1", self.layout.link_ports[0]), SECRET.encode(),
                            tls=self.monitor)


async def measure(pipeline: Pipeline, url: str, args: argparse.Namespace,
                  num_stages: int) -> list[dict[str, Any]]:
    spec = WorkloadSpec(concurrency=(args.concurrency,), num_requests=args.requests,
                        prompt_words=IntRange(args.prompt_tokens, args.prompt_tokens),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens))
    rows = []
    async with make_client(args.concurrency) as client:
        for rate in args.rate_mbit:
            for index, rtt in enumerate(args.rtt_ms):
                pipeline.shape(rtt, rate)
                wait_pipeline_connected(url)
                target = await warm_up(client, await resolve_target(client, "split", url),
                                       spec, 300.0)
                before = pipeline.status()["chain"]
                level = await run_level(client, target, build_level(spec, index),
                                        args.concurrency, temperature=0.0, timeout_s=300.0,
                                        on_done=ProgressHook().request_done)
                after = pipeline.status()["chain"]
                metrics = level_metrics(level)
                moved = sum(after[k] - before[k] for k in ("bytes_out", "bytes_in"))
                rows.append({"stages": num_stages, "rtt_ms": rtt, "rate_mbit": rate,
                             "output_tok_s": metrics.output_tok_s,
                             "ttft_p50_ms": metrics.ttft_ms.p50, "errors": metrics.errors,
                             "bytes_per_token": moved / max(metrics.output_tokens, 1)})
                console.print(f"{num_stages} stages, {rate:g} Mbit/s, RTT {rtt:g} ms: "
                              f"{metrics.output_tok_s:.1f} tok/s, TTFT p50 "
                              f"{metrics.ttft_ms.p50 or 0:.0f} ms, errors {metrics.errors}")
    pipeline.unshape()
    return rows


def table(rows: list[dict[str, Any]], concurrency: int) -> Table:
    out = Table(title=f"{concurrency} streams through shaped links")
    for column in ("stages", "bandwidth", "RTT", "tok/s", "vs 0 ms", "TTFT p50",
                   "link B/token", "errors"):
        out.add_column(column, justify="right")
    for row in rows:
        base = next((r for r in rows if r["stages"] == row["stages"]
                     and r["rate_mbit"] == row["rate_mbit"] and r["rtt_ms"] == 0), None)
        share = (f"{row['output_tok_s'] / base['output_tok_s']:.2f}x"
                 if base and base["output_tok_s"] else "-")
        out.add_row(str(row["stages"]), f"{row['rate_mbit']:g} Mbit/s", f"{row['rtt_ms']:g} ms",
                    f"{row['output_tok_s']:.1f}", share, f"{row['ttft_p50_ms'] or 0:.0f} ms",
                    f"{row['bytes_per_token']:.0f}", str(sum(row["errors"].values())))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_stages in args.stages:
            workdir = Path(tmp) / f"chain{num_stages}"
            workdir.mkdir()
            pipeline = Pipeline(workdir, num_stages, args)
            with contextlib.ExitStack() as stack:
                stack.callback(pipeline.unshape)
                console.print(f"starting a {num_stages}-stage chain …")
                url = pipeline.start(stack)
                rows += asyncio.run(measure(pipeline, url, args, num_stages))
    console.print(table(rows, args.concurrency))
    rtt, share = TARGET
    for row in rows:
        base = next((r for r in rows if r["stages"] == row["stages"]
                     and r["rate_mbit"] == row["rate_mbit"] and r["rtt_ms"] == 0), None)
        if row["rtt_ms"] == rtt and base and base["output_tok_s"]:
            ratio = row["output_tok_s"] / base["output_tok_s"]
            verdict = "[green]MET[/]" if ratio >= share else "[red]MISSED[/]"
            console.print(f"{verdict} {row['stages']} stages at {row['rate_mbit']:g} Mbit/s: "
                          f"RTT {rtt:g} ms keeps {ratio:.2f}x of 0 ms (target >= {share}x)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
