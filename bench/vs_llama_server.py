"""skippyd against llama.cpp's own ``llama-server``: same model, threads, lanes and context.

Both servers run the same llama.cpp kernels, so what differs is scheduling and per-token
overhead. Every round of a workload starts both servers afresh (one process each, up
together for the round: an idle server takes no CPU), alternating which starts first
from round to round. (Two skippyd processes of the same code, started one after the
other and measured alternately, differed by 4.5-8 % in decode step time on a 2-core
host, the later one faster in every test: a server kept up for all rounds would carry
its start's luck into every ratio.) A round runs the workload four times, A, B, B, A in
the order the servers started, each pass with prompts of its own (the same for both
sides); a side's figure in the round is the mean of its two runs, so a drift of the
host's speed across the round (10-20 % from minute to minute on a shared 2-core host)
moves both sides alike. Each target is judged by the median over the rounds of the
round's ratio. Medians of each side's figures are shown too, and the lowest and
highest round ratio: two identical servers measured this way still differ by up to
±10 % in one round on a noisy 2-core host, so a median within a few percent of its
target is a tie, not a verdict to trust. Any request error makes a target NOT MET.

Workloads (prompts are unique per request and round, so no prefix cache helps; in a round
both sides get the same prompts):

* ``streams8``: 8 closed-loop streams, ~60-token prompts, 64 output tokens (``ignore_eos``):
  aggregate output tok/s >= 1.0x, inter-token p50 <= 1.05x and p99 <= 2x, median
  TTFT <= 1.0x.
* ``stream1``: the same with 1 stream: output tok/s >= 1.0x.
* ``cotenant``: 4 streams decode long answers while a unique ~500-word prompt arrives
  every 3 s: the streams' inter-token p99 <= 0.25x, the long prompts' median TTFT <= 1.5x,
  the streams' steady output tok/s >= 1.0x.
* ``prefill``: 4 concurrent 512-word prompts, 1 output token: prompt tok/s >= 1.0x.
* ``cache``: skippyd's ``streams8`` with the prefix cache on against ``mode = "disabled"``:
  on/off output tok/s >= 0.98 (the cache costs nothing when it cannot help).
* ``ceiling``: a bare ``llama_decode`` loop in this run (decode batch 8, prefill of one
  512-token prompt) and the output tok/s it allows for ``streams8``.
* ``longctx``: both servers with their own defaults (no lanes, context or layout given),
  3 streams decoding while one ~6 000-word conversation arrives: both must serve it
  without errors; its time to first token and end to end, and the streams' tok/s and
  inter-token latency are shown side by side.

``--kv-layout`` puts both servers in the same KV layout (llama-server's
``--kv-unified`` / ``--no-kv-unified``; by default a stream per slot, skippyd's default);
``--requests-scale`` (request counts, prefill
groups, cotenant arrivals), ``--output-tokens`` and ``--long-interval`` size the
workloads for a slower model (a round in minutes).

For the closed-loop workloads each run also reads the server's per-thread CPU (Linux):
the summary shows its CPU per output token in the threads busy for most of the run
(llama.cpp's compute threads; in skippyd also the worker's Python between decodes) and
in the rest (the HTTP side), which on two cores the busy threads pay for.

Build llama-server from the llama.cpp that llama-cpp-python vendors (portable, same
kernels), then::

    python bench/vs_llama_server.py --llama-server PATH/TO/llama-server [--rounds 5]
        [--only streams8,cotenant] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from skippyd.bench.chain_config import write_config
from skippyd.bench.loadgen import (
    RequestRecord,
    Target,
    make_client,
    resolve_target,
    run_level,
    send_request,
    warm_up,
)
from skippyd.bench.process import (
    ServerProcess,
    cpu_per_token,
    free_port,
    sigterm_exits,
    skippyd_process,
    thread_cpu_seconds,
)
from skippyd.bench.report import level_metrics
from skippyd.bench.workload import IntRange, RequestSpec, WorkloadSpec, build_level
from skippyd.config import default_model_path

logger = logging.getLogger(__name__)
console = Console(width=None if Console().is_terminal else 140)

LLAMA_SERVER_READY = r"listening on (?P<url>http://\S+)"
WORKLOADS = ("streams8", "stream1", "cotenant", "prefill", "cache", "ceiling", "longctx")
#: Words (about tokens) of ``longctx``'s long conversation.
LONGCTX_WORDS = 6000
SERVERS = ("skippyd", "llama-server")


@dataclass(frozen=True, slots=True)
class Setup:
    """What both servers share."""

    model: Path
    threads: int
    lanes: int
    ctx: int
    llama_server: Path | None
    workdir: Path
    skippyd_extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra skippyd config sections/keys (``--set section.key=value``)."""
    kv_layout: str = "per_lane"
    """Both servers' KV layout: one pool for every slot, or one stream per slot."""
    requests_scale: float = 1.0
    """Multiplies the closed-loop workloads' request counts (a slow model's round)."""
    output_tokens: int = 64
    """Output tokens per request of the closed-loop workloads."""
    long_interval_s: float = 3.0
    """Seconds between the long prompts of ``cotenant``."""


# -- servers -----------------------------------------------------------------------------

def skippyd_config(setup: Setup, name: str, cache_mode: str | None, *,
                   defaults: bool = False) -> Path:
    sizing = {} if defaults else {"ctx_size": setup.ctx, "lane_count": setup.lanes,
                                  "kv_layout": setup.kv_layout}
    sections: dict[str, dict[str, Any]] = {
        "stage": {"id": name, "model_path": str(setup.model)},
        "runtime": {**sizing, "threads": setup.threads, "threads_batch": setup.threads},
        "control": {"socket": str(setup.workdir / f"{name}.sock")},
        "http": {"listen": "127.0.0.1:0"},
    }
    if cache_mode is not None:
        sections["kv_cache"] = {"mode": cache_mode}
    for section, keys in setup.skippyd_extra.items():
        sections.setdefault(section, {}).update(keys)
    return write_config(setup.workdir / f"{name}.toml", sections)


def start_server(setup: Setup, server: str, cache_mode: str | None = None, *,
                 defaults: bool = False) -> ServerProcess:
    """Start one server; with ``defaults`` each sizes its lanes and context itself."""
    env = {"XDG_RUNTIME_DIR": str(setup.workdir)}
    if server == "llama-server":
        assert setup.llama_server is not None
        sizing = [] if defaults else [
            "-np", str(setup.lanes), "-c", str(setup.ctx),
            "--kv-unified" if setup.kv_layout == "unified" else "--no-kv-unified"]
        argv = [str(setup.llama_server), "-m", str(setup.model), *sizing,
                "-t", str(setup.threads), "-tb", str(setup.threads),
                "--host", "127.0.0.1", "--port", str(free_port())]
        return ServerProcess(argv, LLAMA_SERVER_READY, name=server, env=env).start()
    name = server if cache_mode is None else f"{server}-{cache_mode}"
    return skippyd_process(str(skippyd_config(setup, name.replace("/", "-"), cache_mode,
                                              defaults=defaults)), env=env).start()


# -- measurements ------------------------------------------------------------------------

@dataclass(slots=True)
class Measure:
    """One workload on one server in one round: named figures plus error count."""

    figures: dict[str, float]
    errors: int
    error_detail: str = ""
    window: tuple[float, float] | None = None
    """When the measured requests ran (``time.monotonic()``, warm-up excluded); None for
    a mean of runs."""

    @classmethod
    def mean(cls, measures: Sequence[Measure]) -> Measure:
        """One side's runs of a round as one: each figure's mean, every error."""
        return cls({k: statistics.fmean(m.figures[k] for m in measures)
                    for k in measures[0].figures},
                   sum(m.errors for m in measures),
                   "; ".join(m.error_detail for m in measures if m.error_detail))


def _errors(records: Sequence[RequestRecord]) -> tuple[int, str]:
    bad = [r for r in records if not r.ok]
    return len(bad), (f"{bad[0].error}: {bad[0].error_detail}" if bad else "")


async def _target(client: httpx.AsyncClient, proc: ServerProcess, name: str) -> Target:
    target = await resolve_target(client, name, proc.url)
    spec = WorkloadSpec(concurrency=(1,), num_requests=1, prompt_words=IntRange(8, 8),
                        output_tokens=IntRange(4, 4))
    return await warm_up(client, target, spec, 120.0)


async def closed_loop(proc: ServerProcess, name: str, *, streams: int, requests: int,
                      prompt_words: int, output_tokens: int, seed: str) -> Measure:
    spec = WorkloadSpec(concurrency=(streams,), num_requests=requests,
                        prompt_words=IntRange(prompt_words, prompt_words),
                        output_tokens=IntRange(output_tokens, output_tokens), seed=zlib.crc32(seed.encode()))
    async with make_client(streams) as client:
        target = await _target(client, proc, name)
        cpu_before, started = thread_cpu_seconds(proc.pid or 0), time.monotonic()
        level = await run_level(client, target, build_level(spec, 0), streams,
                                temperature=0.0, timeout_s=600.0, on_done=lambda r: None)
        ended = time.monotonic()
        cpu = cpu_per_token(cpu_before, thread_cpu_seconds(proc.pid or 0), ended - started,
                            sum(r.num_output_tokens for r in level.records))
    m = level_metrics(level)
    errors, detail = _errors(level.records)
    return Measure({"output_tok_s": m.output_tok_s, "prompt_tok_s": m.prompt_tok_s,
                    "itl_p50_ms": m.itl_ms.p50 or 0.0, "itl_p99_ms": m.itl_ms.p99 or 0.0,
                    "itl_max_ms": m.itl_ms.max or 0.0, "ttft_p50_ms": m.ttft_ms.p50 or 0.0,
                    "ttft_max_ms": m.ttft_ms.max or 0.0, **cpu}, errors, detail,
                   window=(started, ended))


async def prefill(proc: ServerProcess, name: str, *, seed: str, groups: int = 3) -> Measure:
    """``groups`` times: 4 concurrent 512-word prompts with 1 output token."""
    spec = WorkloadSpec(concurrency=(4,), num_requests=4 * groups,
                        prompt_words=IntRange(512, 512), output_tokens=IntRange(1, 1),
                        seed=zlib.crc32(seed.encode()))
    requests = build_level(spec, 0)
    tokens, seconds, records = 0, 0.0, []
    async with make_client(4) as client:
        target = await _target(client, proc, name)
        for group in range(groups):
            level = await run_level(client, target, requests[4 * group: 4 * group + 4], 4,
                                    temperature=0.0, timeout_s=600.0, on_done=lambda r: None)
            m = level_metrics(level)
            tokens += m.prompt_tokens
            seconds += m.duration_s
            records.extend(level.records)
    errors, detail = _errors(records)
    return Measure({"prompt_tok_s": tokens / seconds}, errors, detail)


async def cotenant(proc: ServerProcess, name: str, *, seed: str, arrivals: int = 8,
                   interval_s: float = 3.0, long_words: int = 500,
                   stream_tokens: int = 256, streams: int = 4,
                   long_tokens: int = 4) -> Measure:
    """``streams`` streams decode while a long prompt arrives every ``interval_s``."""
    stream_spec = WorkloadSpec(concurrency=(streams,), num_requests=64,
                               prompt_words=IntRange(60, 60),
                               output_tokens=IntRange(stream_tokens, stream_tokens),
                               seed=zlib.crc32((seed + "streams").encode()))
    long_spec = WorkloadSpec(concurrency=(1,), num_requests=arrivals,
                             prompt_words=IntRange(long_words, long_words),
                             output_tokens=IntRange(long_tokens, long_tokens),
                             seed=zlib.crc32((seed + "long").encode()))
    stream_requests = iter(build_level(stream_spec, 0))
    long_requests = build_level(long_spec, 0)
    async with make_client(8) as client:
        target = await _target(client, proc, name)
        start = time.perf_counter()
        done = asyncio.Event()
        stream_records: list[RequestRecord] = []

        async def stream() -> None:
            while not done.is_set():
                request = next(stream_requests)
                stream_records.append(await send_request(
                    client, target, request, temperature=0.0, level_start=start,
                    timeout_s=600.0))

        async def long_prompt(index: int, request: RequestSpec) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + 1.0 + index * interval_s - time.perf_counter()))
            return await send_request(client, target, request, temperature=0.0,
                                      level_start=start, timeout_s=600.0)

        tasks = [asyncio.create_task(stream()) for _ in range(streams)]
        long_records = await asyncio.gather(*(long_prompt(i, r)
                                              for i, r in enumerate(long_requests)))
        window = (1.0, max(r.end_s for r in long_records))
        done.set()
        await asyncio.gather(*tasks)
    gaps, chunks = [], 0
    for record in stream_records:
        times = [record.sent_s + t for t in record.chunk_times_s]
        inside = [t for t in times if window[0] <= t <= window[1]]
        chunks += len(inside)
        gaps.extend(b - a for a, b in zip(inside, inside[1:], strict=False))
    errors, detail = _errors(stream_records + list(long_records))
    gaps_ms = np.asarray(gaps) * 1000 if gaps else np.zeros(1)
    return Measure({
        "stream_itl_p50_ms": float(np.percentile(gaps_ms, 50)),
        "stream_itl_p99_ms": float(np.percentile(gaps_ms, 99)),
        "stream_itl_max_ms": float(gaps_ms.max()),
        "long_ttft_p50_ms": statistics.median(r.ttft_s * 1000 for r in long_records
                                              if r.ttft_s is not None) if any(
            r.ttft_s is not None for r in long_records) else 0.0,
        "stream_tok_s": chunks / (window[1] - window[0]),
        "long_e2e_ms": statistics.median((r.end_s - r.sent_s) * 1000 for r in long_records),
    }, errors, detail)


CEILING_CODE = """
import json, sys, time
from llama_cpp import llama_cpp as L
from skippyd.bench.runtime import bare_decode_rate
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
model, threads = sys.argv[1], int(sys.argv[2])
with LlamaRuntime(RuntimeOptions(model, lane_count=8, ctx_size=8192, n_batch=2048,
                                 n_ubatch=512, threads=threads)) as rt:
    bare_decode_rate(rt, 8, 8)
    decode = sorted(bare_decode_rate(rt, 8, 48) for _ in range(3))[1]
    ctx = rt.context
    batch = L.llama_batch_init(512, 0, 1)
    rates = []
    for rep in range(3):
        for i in range(512):
            batch.token[i] = 100 + (i * 37 + rep) % 40000
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == 511
        batch.n_tokens = 512
        started = time.perf_counter()
        L.llama_decode(ctx, batch)
        rates.append(512 / (time.perf_counter() - started))
        L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, -1, -1)
    L.llama_batch_free(batch)
print(json.dumps({"decode_tok_s": decode, "prefill_tok_s": sorted(rates)[1]}))
"""


def ceiling(setup: Setup) -> Measure:
    out = subprocess.run([sys.executable, "-c", CEILING_CODE, str(setup.model),
                          str(setup.threads)], capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    # 60 prompt + 64 output tokens per request, prompts prefilled and outputs decoded at
    # the bare rates: the most output tok/s the streams8 workload can reach.
    figures["streams8_bound_tok_s"] = 64 / (60 / figures["prefill_tok_s"]
                                            + 64 / figures["decode_tok_s"])
    return Measure(figures, 0)


# -- workloads on servers ---------------------------------------------------------------

Runner = Callable[[ServerProcess, str, str], Any]


def runners(setup: Setup) -> dict[str, Runner]:
    """Each workload as a coroutine factory, sized by the setup."""
    def scaled(count: int) -> int:
        return max(1, round(count * setup.requests_scale))

    out = setup.output_tokens
    return {
        "streams8": lambda p, n, s: closed_loop(p, n, streams=8, requests=max(8, scaled(32)),
                                                prompt_words=60, output_tokens=out, seed=s),
        "stream1": lambda p, n, s: closed_loop(p, n, streams=1, requests=scaled(6),
                                               prompt_words=60, output_tokens=out, seed=s),
        "cotenant": lambda p, n, s: cotenant(p, n, seed=s, interval_s=setup.long_interval_s,
                                             arrivals=max(3, scaled(8))),
        "prefill": lambda p, n, s: prefill(p, n, seed=s, groups=scaled(3)),
        # Both servers with their own defaults: 3 streams beside one long conversation.
        "longctx": lambda p, n, s: cotenant(p, n, seed=s, arrivals=1, interval_s=0.0,
                                            long_words=LONGCTX_WORDS, streams=3,
                                            stream_tokens=out, long_tokens=32),
    }


def measure(setup: Setup, proc: ServerProcess, workload: str, server: str,
            seed: str) -> Measure:
    return asyncio.run(runners(setup)["streams8" if workload == "cache" else workload](
        proc, server, seed))


def stop_server(proc: ServerProcess, server: str) -> None:
    code = proc.stop()
    if code not in (0, None):
        logger.warning("%s exited with %s", server, code)


#: workload -> [(figure, higher is better, target ratio skippyd / anchor)].
TARGETS: dict[str, list[tuple[str, bool, float | None]]] = {
    "streams8": [("output_tok_s", True, 1.0), ("itl_p50_ms", False, 1.05),
                 ("itl_p99_ms", False, 2.0), ("ttft_p50_ms", False, 1.0)],
    "stream1": [("output_tok_s", True, 1.0)],
    "cotenant": [("stream_itl_p99_ms", False, 0.25), ("long_ttft_p50_ms", False, 1.5),
                 ("stream_tok_s", True, 1.0)],
    "prefill": [("prompt_tok_s", True, 1.0)],
    "cache": [("output_tok_s", True, 0.98)],
    # No ratio target: MET when both servers serve it, with their defaults, error-free.
    "longctx": [("long_ttft_p50_ms", False, None), ("long_e2e_ms", False, None),
                ("stream_tok_s", True, None), ("stream_itl_p50_ms", False, None),
                ("stream_itl_p99_ms", False, None)],
}


@dataclass(slots=True)
class Result:
    """Every round's figures of one workload: side name -> list of Measures."""

    sides: dict[str, list[Measure]] = field(default_factory=dict)

    def median(self, side: str, figure: str) -> float:
        return statistics.median(m.figures[figure] for m in self.sides[side])

    def ratios(self, ours: str, anchor: str, figure: str) -> list[float]:
        """Each round's ``ours / anchor``."""
        return [a.figures[figure] / b.figures[figure] if b.figures[figure] else float("inf")
                for a, b in zip(self.sides[ours], self.sides[anchor], strict=True)]

    def errors(self) -> int:
        return sum(m.errors for measures in self.sides.values() for m in measures)


def run_all(setup: Setup, workloads: Sequence[str], rounds: int) -> dict[str, Result]:
    results = {w: Result() for w in workloads}
    for workload in workloads:
        result = results[workload]
        if workload == "ceiling":
            for _ in range(rounds):
                result.sides.setdefault("bare", []).append(ceiling(setup))
            continue
        if workload == "cache":
            sides = [("cache on", "skippyd", None), ("cache off", "skippyd", "disabled")]
        else:
            sides = [(s, s, None) for s in SERVERS]
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            procs: dict[str, ServerProcess] = {}
            try:
                for label, server, cache_mode in order:
                    procs[label] = start_server(setup, server, cache_mode,
                                                defaults=workload == "longctx")
                runs: dict[str, list[Measure]] = {}
                # A, B, B, A: a drift of the host's speed across the round hits both
                # sides alike. Each pass has its own prompts, the same for both sides.
                for run, (label, server, _) in enumerate([*order, *order[::-1]]):
                    m = measure(setup, procs[label], workload, server,
                                f"{workload}:{r}:{run // len(order)}")
                    runs.setdefault(label, []).append(m)
                    console.print(f"round {r + 1} {workload} {label}: "
                                  + ", ".join(f"{k} {v:.1f}" for k, v in m.figures.items())
                                  + (f" [red]{m.errors} errors: {m.error_detail}[/]"
                                     if m.errors else ""), highlight=False)
                for label, measures in runs.items():
                    result.sides.setdefault(label, []).append(Measure.mean(measures))
            finally:
                for label, server, _ in order:
                    if label in procs:
                        stop_server(procs[label], server)
    return results


def verdicts(results: dict[str, Result]) -> list[dict[str, Any]]:
    rows = []
    for workload, targets in TARGETS.items():
        result = results.get(workload)
        if result is None or not result.sides:
            continue
        ours, anchor = ("cache on", "cache off") if workload == "cache" else SERVERS
        for figure, higher, target in targets:
            a, b = result.median(ours, figure), result.median(anchor, figure)
            round_ratios = result.ratios(ours, anchor, figure)
            ratio = statistics.median(round_ratios)
            if target is None:
                met, shown = result.errors() == 0, "serves it"
            else:
                met = (ratio >= target if higher else ratio <= target) and result.errors() == 0
                shown = f"{'>=' if higher else '<='} {target}"
            rows.append({"workload": workload, "figure": figure, ours: a, anchor: b,
                         "ratio": ratio, "round_ratios": [min(round_ratios), max(round_ratios)],
                         "target": shown,
                         "errors": result.errors(), "met": met,
                         "sides": (ours, anchor)})
    return rows


def print_results(results: dict[str, Result], rows: list[dict[str, Any]]) -> None:
    table = Table(title="skippyd vs its anchor (llama-server; for cache, skippyd with the"
                        " cache off): medians over rounds, ratio the median of the rounds'"
                        " ratios")
    for column in ("workload", "figure", "skippyd", "anchor", "ratio", "rounds' ratios",
                   "target", "errors", "verdict"):
        table.add_column(column, justify="right")
    for row in rows:
        ours, anchor = row["sides"]
        table.add_row(row["workload"], row["figure"], f"{row[ours]:.1f}",
                      f"{row[anchor]:.1f} ({anchor})", f"{row['ratio']:.3f}",
                      "{:.2f}-{:.2f}".format(*row["round_ratios"]), row["target"],
                      str(row["errors"]),
                      "[green]MET[/]" if row["met"] else "[red]NOT MET[/]")
    console.print(table)
    for workload in ("streams8", "stream1", "cache"):
        result = results.get(workload)
        measures = [m for ms in (result.sides.values() if result else ()) for m in ms]
        if measures and all("cpu_busy_ms_per_token" in m.figures for m in measures):
            assert result is not None
            console.print(f"{workload} CPU ms per output token (busy threads + the rest): "
                          + "; ".join(f"{side} {result.median(side, 'cpu_busy_ms_per_token'):.2f}"
                                      f" + {result.median(side, 'cpu_rest_ms_per_token'):.2f}"
                                      for side in result.sides), highlight=False)
    if "ceiling" in results and results["ceiling"].sides:
        c = results["ceiling"]
        console.print(
            f"bare llama_decode in this run: decode batch 8 {c.median('bare', 'decode_tok_s'):.1f}"
            f" tok/s, prefill {c.median('bare', 'prefill_tok_s'):.1f} tok/s; streams8 bound"
            f" {c.median('bare', 'streams8_bound_tok_s'):.1f} output tok/s")
        if "streams8" in results and results["streams8"].sides:
            bound = c.median("bare", "streams8_bound_tok_s")
            for side in SERVERS:
                console.print(f"  {side}: {results['streams8'].median(side, 'output_tok_s') / bound:.2f}"
                              " of the bound")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, help="the llama-server binary")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--kv-layout", choices=("unified", "per_lane"), default="per_lane",
                        help="both servers' KV layout: llama-server's --kv-unified or "
                             "--no-kv-unified, skippyd's runtime.kv_layout")
    parser.add_argument("--requests-scale", type=float, default=1.0,
                        help="scale the request counts of every workload (e.g. 0.5 for a 1B "
                             "model): closed-loop requests, prefill groups, cotenant arrivals")
    parser.add_argument("--output-tokens", type=int, default=64,
                        help="output tokens per closed-loop request")
    parser.add_argument("--long-interval", type=float, default=3.0,
                        help="seconds between cotenant's long prompts (about 20 for a 1B "
                             "model, so prefill keeps the machine about half busy)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"workloads, comma-separated (default: {','.join(WORKLOADS)})")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra skippyd config key (repeatable), e.g. runtime.n_ubatch=256")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--only: unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    needs_anchor = set(args.workloads) & {"streams8", "stream1", "cotenant", "prefill",
                                          "longctx"}
    if needs_anchor and args.llama_server is None:
        parser.error(f"--llama-server is needed for {sorted(needs_anchor)}")
    return args


def _parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    extra: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        extra.setdefault(section, {})[name] = value
    return extra


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="skippyd-vs-") as tmp, sigterm_exits():
        setup = Setup(model=(args.model or default_model_path()).resolve(),
                      threads=args.threads, lanes=args.lanes, ctx=args.ctx,
                      llama_server=args.llama_server, workdir=Path(tmp),
                      skippyd_extra=_parse_sets(args.set), kv_layout=args.kv_layout,
                      requests_scale=args.requests_scale, output_tokens=args.output_tokens,
                      long_interval_s=args.long_interval)
        results = run_all(setup, args.workloads, args.rounds)
    rows = verdicts(results)
    print_results(results, rows)
    if args.json is not None:
        body = {"setup": {"threads": args.threads, "lanes": args.lanes, "ctx": args.ctx,
                          "rounds": args.rounds, "skippyd_set": args.set},
                "verdicts": [{k: v for k, v in row.items() if k != "sides"} for row in rows],
                "rounds": {w: {side: [{"figures": m.figures, "errors": m.errors}
                                      for m in measures]
                               for side, measures in r.sides.items()}
                           for w, r in results.items()}}
        args.json.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return 0 if all(row["met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
