"""One machine per stage, simulated on one host: each stage process on cores of its own.

Each stage of an N-stage chain (layer ranges as ``skippyd config split`` plans them, or
``--cuts``) is pinned with ``os.sched_setaffinity`` to ``--cores-per-stage`` cores of its
own and runs that many llama.cpp threads; the anchor is the unsplit model pinned to stage
0's cores with the same threads, one machine that could hold it all. At RTT 0 the links
are direct; at RTT > 0 every link, the return path included, goes through the userspace
shaper (``skippyd.bench.shaper``). The load generator and the shapers run unpinned.
Servers start afresh every round, chain and unsplit alternate their order from round to
round, and every pass has prompts of its own. It reports output tok/s, TTFT, ITL p50/p99,
decode ms per token, each stage's busy fraction and each process's RSS, and a verdict per
target (the median over rounds of the per-round ratio; any error is NOT MET)::

    python bench/split_machines.py [--stages 2] [--cores-per-stage 1] [--rtt 0,5,20] \\
        [--streams 1,8,16] [--rounds 3] [--only streams,prefill,greedy,memory] \\
        [--unpinned] [--model MODEL.gguf] [--set runtime.KEY=VALUE] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import operator
import os
import statistics
import sys
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from skippyd.bench.chain_config import LocalChain, write_config
from skippyd.bench.loadgen import (
    BenchError,
    RequestRecord,
    make_client,
    resolve_target,
    run_level,
    warm_up,
)
from skippyd.bench.models import add_model_option, model_path
from skippyd.bench.process import (
    SKIPPYD_READY,
    STAGE_READY,
    ServerProcess,
    sigterm_exits,
    wait_pipeline_connected,
)
from skippyd.bench.report import level_metrics
from skippyd.bench.shaper import READY_LINE
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level
from skippyd.link.dialer import query_status
from skippyd.split_plan import model_costs, plan_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_server import _parse_sets  # noqa: E402  (a sibling script)

logger = logging.getLogger(__name__)
console = Console(width=None if Console().is_terminal else 140)

SECRET = "split-machines-bench-secret-0123456789"
#: How long a chain may take to connect (a large model's stages load slowly).
CONNECT_TIMEOUT_S = 120.0
WORKLOADS = ("streams", "prefill", "greedy", "memory")
#: Streams -> least chain / unsplit output tok/s (pinned: the unsplit on one stage's cores).
STREAM_TARGETS = {8: 1.6, 16: 1.7}
#: One stream: least chain / unsplit output tok/s, per mode.
ONE_STREAM_TARGETS = {"pinned": 0.9, "unpinned": 0.97}
#: Least chain / unsplit prompt tok/s of one long prompt (pinned).
PREFILL_TARGET = 1.4
#: Decode ms per token at RTT r, less that at 0 ms, may exceed the ring's own delay
#: (each of the N links adds r / 2 one way: r for 2 stages) by this much.
LINK_SLACK_MS = 1.0
#: Most a stage's RSS may be of the unsplit process's.
MEMORY_TARGET = 0.6
#: Greedy prompts per pass (before ``--requests-scale``).
GREEDY_PROMPTS = 3
#: Runs ``skippyd serve`` pinned from its first instruction: every thread it starts
#: (the worker, llama.cpp's) inherits the affinity. ``sys.argv[1]``: the CPUs.
PIN_AND_EXEC = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in "
                "sys.argv[1].split(',')}); os.execv(sys.argv[2], sys.argv[2:])")


# -- options -----------------------------------------------------------------------------

def _numbers(kind: Callable[[str], Any], option: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option}: expected numbers separated by "
                                             f"commas (got {text!r})") from None
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{option}: expected numbers >= 0 (got {text!r})")
        return list(dict.fromkeys(values))  # in order, without repeats
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser)
    parser.add_argument("--stages", type=int, default=2, help="stages of the chain (default 2)")
    parser.add_argument("--cores-per-stage", type=int, default=1,
                        help="cores (and llama.cpp threads) of each stage and of the unsplit "
                             "model (default 1); stages beyond the machine's cores share them")
    parser.add_argument("--cuts", type=_numbers(int, "--cuts"), default=None,
                        help="first layer of stages 1..N-1, e.g. 17 (default: the cut "
                             "`skippyd config split` plans)")
    parser.add_argument("--rtt", type=_numbers(float, "--rtt"), default=[0.0],
                        help="round-trip times of the links, ms, e.g. 0,5,20 (default 0: "
                             "direct links; > 0 through the shaper)")
    parser.add_argument("--streams", type=_numbers(int, "--streams"), default=[1, 8, 16],
                        help="concurrent streams of the streams workload (default 1,8,16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, servers started "
                        "afresh each, order alternating (default 3)")
    parser.add_argument("--output-tokens", type=int, default=64,
                        help="output tokens per request (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=60,
                        help="prompt words (about tokens) per request (default 60)")
    parser.add_argument("--prefill-tokens", type=int, default=2000,
                        help="words (about tokens) of the prefill workload's prompt "
                             "(default 2000)")
    parser.add_argument("--requests-scale", type=float, default=1.0,
                        help="scale the requests of every workload (e.g. 0.25 for a 1b model)")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"workloads, comma-separated (default {','.join(WORKLOADS)})")
    parser.add_argument("--unpinned", action="store_true",
                        help="pin no process: stages and the unsplit model still run "
                             "--cores-per-stage threads each")
    parser.add_argument("--lanes", type=int, default=None,
                        help="lanes of every server (default: the most streams)")
    parser.add_argument("--ctx", type=int, default=None,
                        help="tokens one request may hold on every server, each lane its "
                             "own KV stream (default: what the workloads need)")
    parser.add_argument("--slice-cache", type=Path, default=None,
                        help="where stages keep their slices (default: a temporary "
                             "directory; give one to reuse a large model's slices)")
    parser.add_argument("--set", action="append", default=[], metavar="runtime.KEY=VALUE",
                        help="a [runtime] key for every server, the chain's and the unsplit "
                             "one's alike (repeatable), e.g. runtime.target_decode_steps=0")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    sets = []
    for item in args.set:
        key, sep, value = (part.strip() for part in item.partition("="))
        section, dot, name = key.partition(".")
        if not sep or section != "runtime" or not dot or not name.isidentifier() or not value:
            parser.error(f"--set: expected runtime.KEY=VALUE, got {item!r}")
        sets.append(f"{key}={value}")
    args.runtime_extra = _parse_sets(sets).get("runtime", {})  # a later one wins
    args.workloads = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"--only: unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    for name in ("stages", "cores_per_stage", "rounds", "output_tokens", "prompt_tokens",
                 "prefill_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.stages < 2:
        parser.error("--stages: a chain has at least 2 stages")
    if any(s < 1 for s in args.streams):
        parser.error("--streams: each must be >= 1")
    if args.requests_scale <= 0:
        parser.error("--requests-scale: must be > 0")
    if args.cuts is not None and len(args.cuts) != args.stages - 1:
        parser.error(f"--cuts: {args.stages - 1} cut(s) for {args.stages} stages")
    args.cpus = sorted(os.sched_getaffinity(0))
    if args.cores_per_stage > len(args.cpus):
        parser.error(f"--cores-per-stage: this machine has {len(args.cpus)} CPUs")
    args.mode = "unpinned" if args.unpinned else "pinned"
    args.lanes = args.lanes or max(args.streams)
    if args.ctx is None:
        needed = max(args.prompt_tokens, args.prefill_tokens) + args.output_tokens
        args.ctx = max(1024, 256 * math.ceil(needed * 1.25 / 256))
    return args


def assign_cores(cpus: Sequence[int], stages: int, per_stage: int) -> list[tuple[int, ...]]:
    """Each stage's cores: the next ``per_stage`` CPUs, wrapping round when the machine
    has fewer than ``stages * per_stage`` (then later stages share earlier ones' cores)."""
    return [tuple(sorted({cpus[(i * per_stage + k) % len(cpus)] for k in range(per_stage)}))
            for i in range(stages)]


def layer_ranges(args: argparse.Namespace) -> tuple[int, ...]:
    """``(0, cut, ..., n_layer)``: ``--cuts``, or the planner of ``skippyd config split``.

    Raises:
        ValueError: The cuts do not fit the model, or it cannot be cut into that many.
    """
    costs = model_costs(model_path(args))
    n_layer = len(costs.layers)
    if args.cuts is not None:
        bounds = (0, *args.cuts, n_layer)
        if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"--cuts: must rise strictly within 1..{n_layer - 1}")
        return bounds
    plans = plan_split(costs, args.stages)
    return (*(plan.layer_start for plan in plans), n_layer)


# -- servers -----------------------------------------------------------------------------

def _runtime(args: argparse.Namespace, slices: Path) -> dict[str, Any]:
    threads = args.cores_per_stage
    return {"ctx_size": args.ctx * args.lanes, "lane_count": args.lanes,
            "kv_layout": "per_lane", "threads": threads, "threads_batch": threads,
            "slice_cache_dir": str(slices), **args.runtime_extra}


def _model(args: argparse.Namespace) -> dict[str, str]:
    return {"model_path": str(model_path(args).resolve())}


def serve(config: Path, ready: str, name: str, cores: tuple[int, ...] | None) -> ServerProcess:
    """``skippyd serve`` of ``config``; pinned to ``cores`` from its start when given."""
    argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", str(config)]
    if cores is not None:
        argv = [sys.executable, "-c", PIN_AND_EXEC, ",".join(map(str, cores)), *argv]
    return ServerProcess(argv, ready, name=name)


@dataclass(slots=True)
class Server:
    """One started server process and the cores it must run on (None: unpinned)."""

    name: str
    proc: ServerProcess
    cores: tuple[int, ...] | None

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid


def start_unsplit(workdir: Path, args: argparse.Namespace, slices: Path,
                  cores: tuple[int, ...] | None, stack: contextlib.ExitStack) -> Server:
    config = write_config(workdir / "unsplit.toml", {
        "stage": {"id": "unsplit", **_model(args)}, "runtime": _runtime(args, slices),
        "http": {"listen": "127.0.0.1:0"},
        "control": {"socket": str(workdir / "unsplit.sock")}})
    return Server("unsplit", stack.enter_context(serve(config, SKIPPYD_READY, "unsplit", cores)),
                  cores)


class Chain:
    """The N stage processes; ``shaped``: every link goes through a shaper port
    (:class:`~skippyd.bench.chain_config.LocalChain` says which)."""

    def __init__(self, workdir: Path, args: argparse.Namespace, bounds: Sequence[int],
                 cores: Sequence[tuple[int, ...] | None], slices: Path, *,
                 shaped: bool) -> None:
        self.args, self.cores, self.slices = args, cores, slices
        self.layout = LocalChain.on_free_ports(workdir, bounds, SECRET, shaped=shaped)
        self.num_stages = self.layout.num_stages
        self.shapers: list[ServerProcess] = []
        self.stages: list[Server] = []
        self.url = ""

    def config(self, i: int) -> Path:
        return self.layout.write(i, stage=_model(self.args),
                                 runtime=_runtime(self.args, self.slices))

    def start(self, stack: contextlib.ExitStack) -> Chain:
        """Start every stage, the last first; a direct chain is connected on return."""
        stack.callback(self.unshape)
        for i in reversed(range(self.num_stages)):
            name = f"stage-{i}"
            proc = stack.enter_context(serve(self.config(i), SKIPPYD_READY if i == 0
                                             else STAGE_READY, name, self.cores[i]))
            self.stages.insert(0, Server(name, proc, self.cores[i]))
        self.url = self.stages[0].proc.url
        if not self.layout.shaper_ports:
            wait_pipeline_connected(self.url, CONNECT_TIMEOUT_S)
        return self

    def shape(self, rtt_ms: float) -> None:
        """(Re)start every shaper at this RTT and wait until the chain is connected."""
        self.unshape()
        for port, target in self.layout.shaper_routes():
            argv = [sys.executable, "-m", "skippyd.bench.shaper", "--listen",
                    f"127.0.0.1:{port}", "--target", f"127.0.0.1:{target}",
                    "--rtt-ms", str(rtt_ms)]
            self.shapers.append(ServerProcess(argv, READY_LINE, name=f"shaper-{port}").start())
        wait_pipeline_connected(self.url, CONNECT_TIMEOUT_S)

    def unshape(self) -> None:
        while self.shapers:
            self.shapers.pop().stop()

    def status(self) -> list[dict[str, Any]]:
        """Every stage's STATUS, read over its own link listener (never shaped)."""
        return [query_status(("127.0.0.1", port), SECRET.encode())
                for port in self.layout.link_ports]


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of ``pid`` may run on."""
    out: dict[int, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


def check_pinned(server: Server) -> list[int]:
    """The CPUs the server's threads run on; raises when a thread strays from its cores."""
    affinities = thread_affinities(server.pid)
    cpus = sorted(set().union(*affinities.values())) if affinities else []
    if server.cores is not None:
        stray = {tid: sorted(a) for tid, a in affinities.items() if a != set(server.cores)}
        if stray:
            raise BenchError(f"{server.name}: threads {stray} are not pinned to CPUs "
                             f"{list(server.cores)}")
    return cpus


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid``, KiB."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key.lower() + "_kib"] = int(value.split()[0])
    return out


# -- workloads on one server -------------------------------------------------------------

def _seed(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())


def _requests(args: argparse.Namespace, streams: int) -> int:
    return max(streams, round(args.requests_scale * max(6, 4 * streams)))


def ms_per_token(records: Sequence[RequestRecord]) -> float | None:
    """Decode time per token: the gaps from each request's first token to its last."""
    span = sum(r.chunk_times_s[-1] - r.chunk_times_s[0] for r in records
               if r.ok and len(r.chunk_times_s) > 1)
    gaps = sum(len(r.chunk_times_s) - 1 for r in records if r.ok and len(r.chunk_times_s) > 1)
    return 1000.0 * span / gaps if gaps else None


def _errors(records: Sequence[RequestRecord]) -> tuple[int, str]:
    bad = [r for r in records if not r.ok]
    return len(bad), (f"{bad[0].error}: {bad[0].error_detail}" if bad else "")


def chain_figures(before: list[dict[str, Any]], after: list[dict[str, Any]],
                  tokens: int) -> dict[str, Any]:
    """Each stage's busy fraction (time in llama.cpp / wall time) and link bytes per token."""
    busy = []
    for old, new in zip(before, after, strict=True):
        wall = new["uptime_s"] - old["uptime_s"]
        busy.append((new.get("busy_s", 0.0) - old.get("busy_s", 0.0)) / wall if wall > 0
                    else 0.0)
    old_chain, new_chain = before[0].get("chain", {}), after[0].get("chain", {})
    moved = sum(new_chain.get(k, 0) - old_chain.get(k, 0) for k in ("bytes_out", "bytes_in"))
    return {"busy": busy, "link_bytes_per_token": moved / max(tokens, 1)}


async def _warm(url: str, name: str) -> None:
    spec = WorkloadSpec(concurrency=(1,), num_requests=1, prompt_words=IntRange(8, 8),
                        output_tokens=IntRange(4, 4))
    async with make_client(1) as client:
        await warm_up(client, await resolve_target(client, name, url), spec, 600.0)


async def streams_cell(url: str, name: str, args: argparse.Namespace, streams: int,
                       seed: int, status: Callable[[], list[dict[str, Any]]] | None
                       ) -> dict[str, Any]:
    """``streams`` closed-loop streams of unique prompts, exact output lengths."""
    spec = WorkloadSpec(concurrency=(streams,), num_requests=_requests(args, streams),
                        prompt_words=IntRange(args.prompt_tokens, args.prompt_tokens),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens),
                        seed=seed)
    async with make_client(streams) as client:
        target = await resolve_target(client, name, url)
        before = status() if status else None
        level = await run_level(client, target, build_level(spec, 0), streams,
                                temperature=0.0, timeout_s=900.0, on_done=lambda r: None)
        after = status() if status else None
    m = level_metrics(level)
    errors, detail = _errors(level.records)
    figures = {"output_tok_s": m.output_tok_s, "ttft_p50_ms": m.ttft_ms.p50,
               "itl_p50_ms": m.itl_ms.p50, "itl_p99_ms": m.itl_ms.p99,
               "ms_per_token": ms_per_token(level.records)}
    cell: dict[str, Any] = {"figures": figures, "errors": errors, "error_detail": detail}
    if before is not None and after is not None:
        cell.update(chain_figures(before, after, m.output_tokens))
    return cell


async def prefill_cell(url: str, name: str, args: argparse.Namespace, seed: int,
                       status: Callable[[], list[dict[str, Any]]] | None) -> dict[str, Any]:
    """Long prompts one at a time, 1 output token each: prompt tokens / time to first token."""
    count = max(1, round(2 * args.requests_scale))
    spec = WorkloadSpec(concurrency=(1,), num_requests=count,
                        prompt_words=IntRange(args.prefill_tokens, args.prefill_tokens),
                        output_tokens=IntRange(1, 1), seed=seed)
    async with make_client(1) as client:
        target = await resolve_target(client, name, url)
        before = status() if status else None
        level = await run_level(client, target, build_level(spec, 0), 1, temperature=0.0,
                                timeout_s=900.0, on_done=lambda r: None)
        after = status() if status else None
    ok = [r for r in level.records if r.ok and r.ttft_s]
    tokens = sum(r.num_prompt_tokens or r.num_prompt_words for r in ok)
    seconds = sum(r.ttft_s or 0.0 for r in ok)
    errors, detail = _errors(level.records)
    m = level_metrics(level)
    cell: dict[str, Any] = {
        "figures": {"prompt_tok_s": tokens / seconds if seconds else None,
                    "ttft_p50_ms": m.ttft_ms.p50, "prompt_tokens": tokens / max(len(ok), 1)},
        "errors": errors, "error_detail": detail}
    if before is not None and after is not None:
        cell.update(chain_figures(before, after, max(tokens, 1)))
    return cell


def greedy_prompts(args: argparse.Namespace, round_: int, rtt: float) -> list[str]:
    spec = WorkloadSpec(concurrency=(1,),
                        num_requests=max(1, round(GREEDY_PROMPTS * args.requests_scale)),
                        prompt_words=IntRange(args.prompt_tokens, args.prompt_tokens),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens),
                        seed=_seed("greedy", round_, rtt))
    return [request.prompt for request in build_level(spec, 0)]


async def greedy_cell(url: str, name: str, args: argparse.Namespace,
                      prompts: Sequence[str]) -> dict[str, Any]:
    """Each prompt's greedy continuation, one request at a time (texts, for comparing)."""
    texts: list[str | None] = []
    errors, detail = 0, ""
    async with make_client(1) as client:
        target = await resolve_target(client, name, url)
        for prompt in prompts:
            body = {"model": target.model, "prompt": prompt, "max_tokens": args.output_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            try:
                response = await client.post(f"{target.base_url}/completions", json=body)
                response.raise_for_status()
                texts.append(str(response.json()["choices"][0]["text"]))
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                texts.append(None)
                errors += 1
                detail = detail or f"{type(exc).__name__}: {exc}"
    return {"figures": {}, "texts": texts, "errors": errors, "error_detail": detail}


# -- rounds ------------------------------------------------------------------------------

@dataclass(slots=True)
class Results:
    """Everything measured: one cell per (round, side, workload, RTT, streams)."""

    cells: list[dict[str, Any]] = field(default_factory=list)
    rss: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, list[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, cell: dict[str, Any], *, round_: int, side: str, workload: str,
            rtt_ms: float, streams: int) -> None:
        cell.update(round=round_, side=side, workload=workload, rtt_ms=rtt_ms, streams=streams)
        self.cells.append(cell)
        figures = cell["figures"]
        shown = ", ".join(f"{k} {v:.1f}" for k, v in figures.items() if v is not None)
        if "texts" in cell:
            shown = f"{len(cell['texts'])} greedy texts"
        busy = ("; busy " + "/".join(f"{b:.0%}" for b in cell["busy"])) if "busy" in cell else ""
        errors = f" [red]{cell['errors']} errors: {escape(cell['error_detail'])}[/]" \
            if cell["errors"] else ""
        console.print(f"round {round_ + 1} {side} {workload} RTT {rtt_ms:g} ms, "
                      f"{streams} stream(s): {shown}{busy}{errors}", highlight=False)

    def read_memory(self, servers: Sequence[Server], round_: int, phase: str) -> None:
        for server in servers:
            self.rss.append({"round": round_, "phase": phase, "process": server.name,
                             **memory_kib(server.pid)})


class Runner:
    """Runs the rounds: a direct phase (the unsplit model, and the chain when RTT 0 is
    asked for) and a shaped phase (the chain through shapers, every RTT > 0)."""

    def __init__(self, args: argparse.Namespace, bounds: Sequence[int], workdir: Path) -> None:
        self.args, self.bounds, self.workdir = args, bounds, workdir
        self.results = Results()
        pinned = not args.unpinned
        cores = assign_cores(args.cpus, args.stages, args.cores_per_stage)
        self.stage_cores: list[tuple[int, ...] | None] = \
            list(cores) if pinned else [None] * args.stages
        self.unsplit_cores = cores[0] if pinned else None
        self.slices = args.slice_cache or workdir / "slices"
        workloads = set(args.workloads)
        self.shaped_rtts = [r for r in args.rtt if r > 0]
        self.direct_chain = 0.0 in args.rtt
        self.shaped = bool(self.shaped_rtts) and bool(
            workloads & {"streams", "greedy"} or ("memory" in workloads and not self.direct_chain))

    def run(self) -> Results:
        for round_ in range(self.args.rounds):
            phases = ["direct", "shaped"] if round_ % 2 == 0 else ["shaped", "direct"]
            for phase in phases:
                if phase == "shaped" and not self.shaped:
                    continue
                directory = self.workdir / f"round{round_}-{phase}"
                directory.mkdir(parents=True)
                try:
                    with contextlib.ExitStack() as stack:
                        (self.direct if phase == "direct" else self.through_shapers)(
                            round_, directory, stack)
                except Exception as exc:  # any failure is reported, and fails its targets
                    logger.debug("round %d %s phase failed", round_ + 1, phase, exc_info=True)
                    self.results.failures.append(
                        f"round {round_ + 1}, {phase} links: {type(exc).__name__}: {exc}")
                    console.print(f"[red]round {round_ + 1}, {phase} links failed:[/] "
                                  f"{escape(str(exc))}", highlight=False)
        return self.results

    def _ready(self, url: str, name: str, servers: Sequence[Server]) -> None:
        """One uncounted request through ``url``, then every server's threads checked."""
        asyncio.run(_warm(url, name))
        for server in servers:
            self.results.affinity[server.name] = check_pinned(server)

    def direct(self, round_: int, directory: Path, stack: contextlib.ExitStack) -> None:
        args, results, w = self.args, self.results, set(self.args.workloads)
        sides = ["split", "unsplit"] if self.direct_chain else ["unsplit"]
        order = sides if round_ % 2 == 0 else sides[::-1]
        chain: Chain | None = None
        unsplit: Server | None = None
        for side in order:  # the start order alternates too
            if side == "split":
                chain = Chain(directory, args, self.bounds, self.stage_cores, self.slices,
                              shaped=False).start(stack)
            else:
                unsplit = start_unsplit(directory, args, self.slices, self.unsplit_cores, stack)
        assert unsplit is not None
        urls = {"unsplit": unsplit.proc.url}
        servers = [unsplit]
        if chain is not None:
            urls["split"] = chain.url
            servers = [*chain.stages, unsplit]
        self._ready(unsplit.proc.url, "unsplit", [unsplit])
        if chain is not None:
            self._ready(chain.url, "split", chain.stages)

        def status(side: str) -> Callable[[], list[dict[str, Any]]] | None:
            return chain.status if side == "split" and chain is not None else None

        if "streams" in w:
            for streams in args.streams:
                seed = _seed("streams", round_, 0.0, streams)
                for side in order:
                    results.add(asyncio.run(streams_cell(urls[side], side, args, streams, seed,
                                                         status(side))),
                                round_=round_, side=side, workload="streams", rtt_ms=0.0,
                                streams=streams)
        if "prefill" in w:
            seed = _seed("prefill", round_)
            for side in order:
                results.add(asyncio.run(prefill_cell(urls[side], side, args, seed,
                                                     status(side))),
                            round_=round_, side=side, workload="prefill", rtt_ms=0.0, streams=1)
        if "greedy" in w:
            for side in order:
                # The unsplit model answers every RTT's prompts: the reference texts.
                for rtt in (args.rtt if side == "unsplit" else [0.0]):
                    results.add(asyncio.run(greedy_cell(urls[side], side, args,
                                                        greedy_prompts(args, round_, rtt))),
                                round_=round_, side=side, workload="greedy", rtt_ms=rtt,
                                streams=1)
        results.read_memory(servers, round_, "direct")

    def through_shapers(self, round_: int, directory: Path, stack: contextlib.ExitStack) -> None:
        args, results, w = self.args, self.results, set(self.args.workloads)
        chain = Chain(directory, args, self.bounds, self.stage_cores, self.slices,
                      shaped=True).start(stack)
        rtts = self.shaped_rtts if round_ % 2 == 0 else self.shaped_rtts[::-1]
        for rtt in rtts:
            chain.shape(rtt)
            self._ready(chain.url, "split", chain.stages)
            if "streams" in w:
                for streams in args.streams:
                    results.add(asyncio.run(streams_cell(
                        chain.url, "split", args, streams,
                        _seed("streams", round_, rtt, streams), chain.status)),
                        round_=round_, side="split", workload="streams", rtt_ms=rtt,
                        streams=streams)
            if "greedy" in w:
                results.add(asyncio.run(greedy_cell(chain.url, "split", args,
                                                    greedy_prompts(args, round_, rtt))),
                            round_=round_, side="split", workload="greedy", rtt_ms=rtt,
                            streams=1)
        results.read_memory(chain.stages, round_, "shaped")


# -- verdicts ----------------------------------------------------------------------------

def _by_round(cells: Sequence[dict[str, Any]], workload: str, side: str, rtt: float,
              streams: int) -> dict[int, dict[str, Any]]:
    return {c["round"]: c for c in cells if c["workload"] == workload and c["side"] == side
            and c["rtt_ms"] == rtt and c["streams"] == streams}


def _verdict(target: str, goal: str, values: list[float], errors: int, rounds: int,
             ok: Callable[[float], bool], *, detail: str = "", unit: str = "x"
             ) -> dict[str, Any]:
    """MET: every round measured, no error, and the median of the rounds' values ``ok``."""
    value = statistics.median(values) if values else None
    met = value is not None and len(values) == rounds and errors == 0 and ok(value)
    notes = [detail] if detail else []
    if len(values) < rounds:
        notes.append(f"{len(values)} of {rounds} rounds measured")
    if errors:
        notes.append(f"{errors} errors")
    return {"target": target, "goal": goal, "value": value, "unit": unit,
            "rounds": values, "errors": errors, "met": met, "note": "; ".join(notes)}


def _ratio_verdict(cells: Sequence[dict[str, Any]], rounds: int, target: str, workload: str,
                   streams: int, figure: str, least: float) -> dict[str, Any]:
    split = _by_round(cells, workload, "split", 0.0, streams)
    base = _by_round(cells, workload, "unsplit", 0.0, streams)
    values = []
    for r in sorted(split.keys() & base.keys()):
        a, b = split[r]["figures"].get(figure), base[r]["figures"].get(figure)
        if a is not None and b:
            values.append(a / b)
    errors = sum(c["errors"] for c in [*split.values(), *base.values()])
    return _verdict(target, f">= {least}x", values, errors, rounds, lambda v: v >= least)


def rss_ratios(results: Results, process: str) -> list[float]:
    """Each round's VmRSS of ``process`` (the largest over the round's phases) over the
    unsplit process's."""
    values = []
    for r in sorted({m["round"] for m in results.rss}):
        mine = [m["vmrss_kib"] for m in results.rss if m["round"] == r
                and m["process"] == process]
        whole = [m["vmrss_kib"] for m in results.rss if m["round"] == r
                 and m["process"] == "unsplit"]
        if mine and whole:
            values.append(max(mine) / whole[0])
    return values


def verdicts(results: Results, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per target this run's options measure (see :func:`unchecked`)."""
    cells, rounds, w = results.cells, args.rounds, set(args.workloads)
    pinned = args.mode == "pinned"
    rows = []
    if "streams" in w and 0.0 in args.rtt:
        if 1 in args.streams:
            least = ONE_STREAM_TARGETS[args.mode]
            rows.append(_ratio_verdict(cells, rounds, f"1 stream, {args.mode}: tok/s vs unsplit",
                                       "streams", 1, "output_tok_s", least))
        for streams, least in STREAM_TARGETS.items():
            if pinned and streams in args.streams:
                rows.append(_ratio_verdict(cells, rounds, f"{streams} streams: tok/s vs unsplit",
                                           "streams", streams, "output_tok_s", least))
    if "streams" in w and 0.0 in args.rtt and 1 in args.streams:
        base = _by_round(cells, "streams", "split", 0.0, 1)
        for rtt in (r for r in args.rtt if r > 0):
            shaped = _by_round(cells, "streams", "split", rtt, 1)
            values = [shaped[r]["figures"]["ms_per_token"] - base[r]["figures"]["ms_per_token"]
                      for r in sorted(shaped.keys() & base.keys())
                      if shaped[r]["figures"].get("ms_per_token") is not None
                      and base[r]["figures"].get("ms_per_token") is not None]
            errors = sum(c["errors"] for c in [*shaped.values(), *base.values()])
            most = args.stages * rtt / 2 + LINK_SLACK_MS
            rows.append(_verdict(f"link cost at RTT {rtt:g} ms: ms/token over 0 ms, 1 stream",
                                 f"<= {most:g} ms", values, errors, rounds,
                                 functools.partial(operator.ge, most), unit=" ms"))
    if "prefill" in w and 0.0 in args.rtt and pinned:
        rows.append(_ratio_verdict(cells, rounds, f"prefill of {args.prefill_tokens} words: "
                                   "prompt tok/s vs unsplit", "prefill", 1, "prompt_tok_s",
                                   PREFILL_TARGET))
    if "greedy" in w:
        for rtt in args.rtt:
            split = _by_round(cells, "greedy", "split", rtt, 1)
            base = _by_round(cells, "greedy", "unsplit", rtt, 1)
            equal = compared = 0
            per_round = []  # each round's share of texts equal
            for r in sorted(split.keys() & base.keys()):
                pairs = list(zip(split[r]["texts"], base[r]["texts"], strict=True))
                same = sum(a is not None and a == b for a, b in pairs)
                equal, compared = equal + same, compared + len(pairs)
                per_round.append(same / len(pairs) if pairs else 0.0)
            errors = sum(c["errors"] for c in [*split.values(), *base.values()])
            row = _verdict(f"greedy output, {args.stages} stages, RTT {rtt:g} ms: equal to "
                           "unsplit", "every text equal", per_round, errors, rounds,
                           lambda v: v == 1.0, detail=f"{equal} of {compared} texts equal",
                           unit="")
            # Any mismatch in any round fails it, whatever the median.
            row["met"] = row["met"] and compared > 0 and equal == compared
            rows.append(row)
    if "memory" in w:
        for i in range(args.stages):
            rows.append(_verdict(f"memory: stage {i} RSS vs unsplit", f"<= {MEMORY_TARGET}x",
                                 rss_ratios(results, f"stage-{i}"), 0, rounds,
                                 lambda v: v <= MEMORY_TARGET))
    if results.failures:
        for row in rows:
            row["met"] = False
            row["note"] = "; ".join(filter(None, [row["note"], "a phase failed"]))
    return rows


def unchecked(args: argparse.Namespace) -> list[str]:
    """The targets this run's options leave out, with the options that check them."""
    w, out = set(args.workloads), []
    if args.mode == "unpinned":
        out.append("8/16 streams and prefill vs the unsplit model on one core (drop --unpinned)")
    if "streams" in w and not {1, 8, 16} <= set(args.streams):
        out.append("1, 8 and 16 streams (--streams 1,8,16)")
    if "streams" in w and not (0.0 in args.rtt and any(r > 0 for r in args.rtt)):
        out.append("link cost (--rtt 0,5,20)")
    if not {"streams", "prefill", "greedy", "memory"} <= w:
        out.append(f"workloads {sorted(set(WORKLOADS) - w)} (--only)")
    return out


# -- report ------------------------------------------------------------------------------

def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def figures_table(results: Results, args: argparse.Namespace) -> Table:
    table = Table(title=f"{args.stages} stages vs unsplit, {args.mode} "
                        f"({args.cores_per_stage} core(s) and threads each): medians over rounds",
                  caption="prefill: the tok/s column is prompt tok/s")
    for column in ("workload", "RTT", "streams", "side", "tok/s", "TTFT p50 ms", "ITL p50 ms",
                   "ITL p99 ms", "ms/token", "busy per stage", "link B/token", "errors"):
        table.add_column(column, justify="right")
    keys = sorted({(c["workload"], c["rtt_ms"], c["streams"], c["side"])
                   for c in results.cells if c["workload"] != "greedy"})
    for workload, rtt, streams, side in keys:
        cells = [c for c in results.cells if (c["workload"], c["rtt_ms"], c["streams"],
                                              c["side"]) == (workload, rtt, streams, side)]

        def med(key: str, cells: list[dict[str, Any]] = cells) -> float | None:
            return _median([c["figures"].get(key) for c in cells])

        rate = med("prompt_tok_s" if workload == "prefill" else "output_tok_s")
        busy = "-"
        if all("busy" in c for c in cells):
            busy = " / ".join(f"{statistics.median(c['busy'][i] for c in cells):.0%}"
                              for i in range(len(cells[0]["busy"])))
        link = _median([c.get("link_bytes_per_token") for c in cells])
        table.add_row(workload, f"{rtt:g} ms", str(streams), side, _num(rate),
                      _num(med("ttft_p50_ms")), _num(med("itl_p50_ms")),
                      _num(med("itl_p99_ms")), _num(med("ms_per_token"), ".2f"), busy,
                      _num(link, ".0f"), str(sum(c["errors"] for c in cells)))
    return table


def memory_table(results: Results) -> Table:
    table = Table(title="resident memory after the workloads (medians over rounds; ratio: "
                        "the median of the rounds' VmRSS / unsplit VmRSS)")
    for column in ("process", "VmRSS MiB", "VmHWM MiB", "VmRSS / unsplit"):
        table.add_column(column, justify="right")
    names = sorted({m["process"] for m in results.rss}, key=lambda n: (n == "unsplit", n))
    for name in names:
        rows = [m for m in results.rss if m["process"] == name]
        table.add_row(name, f"{statistics.median(m['vmrss_kib'] for m in rows) / 1024:.0f}",
                      f"{statistics.median(m['vmhwm_kib'] for m in rows) / 1024:.0f}",
                      _num(_median(rss_ratios(results, name)), ".2f"))
    return table


def verdict_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="targets (median over rounds of each round's figure)")
    table.add_column("target")
    for column in ("value", "rounds", "goal", "verdict", "note"):
        table.add_column(column, justify="right")
    for row in rows:
        fmt = ".3f" if row["unit"] == "x" else ".2f"
        value = "-" if row["value"] is None else f"{row['value']:{fmt}}{row['unit']}"
        spread = (f"{min(row['rounds']):{fmt}}-{max(row['rounds']):{fmt}}"
                  if row["rounds"] else "-")
        table.add_row(row["target"], value, spread, row["goal"],
                      "[green]MET[/]" if row["met"] else "[red]NOT MET[/]", row["note"])
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        bounds = layer_ranges(args)
    except ValueError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    with tempfile.TemporaryDirectory(prefix="skippyd-machines-") as tmp, sigterm_exits():
        runner = Runner(args, bounds, Path(tmp))
        for i in range(args.stages):
            cores = runner.stage_cores[i]
            console.print(f"stage {i}: layers {bounds[i]}-{bounds[i + 1] - 1}, "
                          f"{args.cores_per_stage} thread(s), CPUs "
                          f"{list(cores) if cores is not None else 'any'}", highlight=False)
        console.print(f"unsplit: {args.cores_per_stage} thread(s), CPUs "
                      f"{list(runner.unsplit_cores) if runner.unsplit_cores else 'any'}; load "
                      f"generator and shapers unpinned (CPUs {args.cpus})", highlight=False)
        results = runner.run()
    rows = verdicts(results, args)
    console.print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on "
                  f"{len(args.cpus)} CPUs (other load makes the figures noisy)")
    console.print(figures_table(results, args))
    if results.rss:
        console.print(memory_table(results))
    console.print(verdict_table(rows))
    for failure in results.failures:
        console.print(f"[red]failed:[/] {escape(failure)}", highlight=False)
    left = unchecked(args)
    if left:
        console.print("not checked by this run: " + "; ".join(left), highlight=False)
    if args.json is not None:
        setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("json", "slice_cache", "model")}
        setup["model"] = model_path(args).name
        body = {"setup": setup, "bounds": list(bounds),
                "stage_cores": [list(c) if c else None for c in runner.stage_cores],
                "affinity": results.affinity, "cells": results.cells, "rss": results.rss,
                "failures": results.failures, "verdicts": rows}
        args.json.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return 0 if rows and all(row["met"] for row in rows) and not results.failures else 1


if __name__ == "__main__":
    sys.exit(main())
