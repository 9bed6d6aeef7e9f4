"""Where each server's time goes: every llama.cpp model call of skippyd and llama-server.

``vs_llama_server.py`` says which server is faster; this script says where the difference
lies. Both servers run the same kernels, so a run's time is the time inside the calls that
run the model plus the time between them (sampling, scheduling, the token path). Each
server runs with a hook that logs every such call (start, duration, tokens, output rows,
lowest and highest sequence id):

* llama-server: a shim preloaded with ``LD_PRELOAD`` (C, compiled here with the system C
  compiler) wraps ``llama_process`` and the ``llama_batch_ext`` calls that fill its batch
  (the server's batch API), and ``llama_decode`` for builds that still call that.
* skippyd: a ``sitecustomize`` module put on its ``PYTHONPATH`` wraps llama-cpp-python's
  ``llama_decode`` binding and ``wake_decode.decode_signalling`` (the decode that also
  wakes the event loop), which skippyd's runtime looks up at every call (it shadows any
  other ``sitecustomize`` for that process). The hook's own bookkeeping (a few
  microseconds per row) falls between calls, so skippyd's time outside is slightly
  overstated, and it times the call from Python, so the time inside includes taking the
  GIL back after the call.

The host's speed drifts by 10-20 % from minute to minute, so every time is also given in
*steps*: the median duration of the run's full decode steps (one row per stream, as many
rows as streams). A run is the span of its measured requests: the warm-up request before
them is left out, as in ``vs_llama_server.py`` (skippyd computes its short prompt again
each time, llama-server takes it from the slot's cache). A run's span, time inside calls
and time outside, in steps, compare across runs and servers whatever the host did. Each
round runs the servers A-B-B-A (B-A-A-B in odd rounds); figures are medians over every
run of a side. Calls are also grouped by shape: full decode steps, calls with prompt
tokens (more tokens than outputs), and partial decode steps (fewer rows than streams: a
stream restarting, the tail of a run).

Without ``--llama-server`` only skippyd is measured (useful to compare its own settings
with ``--set``)::

    python bench/decode_calls.py --llama-server PATH/TO/llama-server [--workload streams8]
        [--rounds 3] [--set runtime.target_step_ms=0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_server import (  # noqa: E402  (a sibling script, not a package)
    LLAMA_SERVER_READY,
    Setup,
    _parse_sets,
    closed_loop,
    skippyd_config,
)

from skippyd.bench.process import ServerProcess, free_port, skippyd_process  # noqa: E402
from skippyd.config import default_model_path  # noqa: E402

console = Console()

#: Environment variable naming the file each hook writes its calls to.
TRACE_ENV = "SKIPPYD_DECODE_TRACE"

WORKLOADS = {"streams8": (8, 32), "stream1": (1, 6)}
"""workload -> (closed-loop streams, requests per run); ~60-token prompts, 64 tokens out."""

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct { int32_t n_tokens; int32_t *token; float *embd; int32_t *pos;
                 int32_t *n_seq_id; int32_t **seq_id; int8_t *logits; } llama_batch;

static FILE *out;
static __thread int depth;
static int n_tok, n_out, lo = 1 << 30, hi = -1;

static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
static void *next(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) { fprintf(stderr, "decode trace: %s not found\n", name); abort(); }
    return f;
}
static void record(double start, int tokens, int outputs, int first, int last) {
    if (!out) {
        const char *path = getenv("SKIPPYD_DECODE_TRACE");
        out = fopen(path ? path : "/dev/null", "w");
        if (!out) abort();
    }
    fprintf(out, "%.6f %.6f %d %d %d %d\n", start, now() - start, tokens, outputs, first, last);
    fflush(out);
}

void llama_batch_ext_clear(void *batch) {
    static void (*real)(void *);
    if (!real) real = next("llama_batch_ext_clear");
    n_tok = 0; n_out = 0; lo = 1 << 30; hi = -1;
    real(batch);
}
int32_t llama_batch_ext_add_token(void *batch, int32_t seq, int32_t token) {
    static int32_t (*real)(void *, int32_t, int32_t);
    if (!real) real = next("llama_batch_ext_add_token");
    int32_t index = real(batch, seq, token);
    if (index >= 0) { n_tok++; if (seq < lo) lo = seq; if (seq > hi) hi = seq; }
    return index;
}
bool llama_batch_ext_set_output_logits(void *batch, int32_t index, bool value) {
    static bool (*real)(void *, int32_t, bool);
    if (!real) real = next("llama_batch_ext_set_output_logits");
    if (value) n_out++;
    return real(batch, index, value);
}
int32_t llama_process(void *ctx, int type, void *batch) {
    static int32_t (*real)(void *, int, void *);
    if (!real) real = next("llama_process");
    double start = now();
    depth++;
    int32_t ret = real(ctx, type, batch);
    depth--;
    if (!depth) record(start, n_tok, n_out, lo, hi);
    return ret;
}
int32_t llama_decode(void *ctx, llama_batch batch) {
    static int32_t (*real)(void *, llama_batch);
    if (!real) real = next("llama_decode");
    double start = now();
    depth++;
    int32_t ret = real(ctx, batch);
    depth--;
    if (depth) return ret;
    int outputs = 0, first = 1 << 30, last = -1;
    for (int i = 0; i < batch.n_tokens; i++) {
        int seq = batch.seq_id[i][0];
        outputs += batch.logits ? batch.logits[i] != 0 : i == batch.n_tokens - 1;
        if (seq < first) first = seq;
        if (seq > last) last = seq;
    }
    record(start, batch.n_tokens, outputs, first, last);
    return ret;
}
"""

SITECUSTOMIZE_SOURCE = '''
"""Logs every llama_decode of this process to $SKIPPYD_DECODE_TRACE (bench/decode_calls.py)."""
import os

if os.environ.get("SKIPPYD_DECODE_TRACE"):
    import threading
    import time

    from llama_cpp import llama_cpp as _llama

    from skippyd.engine.runtime import wake_decode as _wake

    _out = open(os.environ["SKIPPYD_DECODE_TRACE"], "w", buffering=1)
    _depth = threading.local()

    def _traced(real):
        # The runtime calls llama_decode through wake_decode when the call also wakes the
        # event loop; without the native helper that one calls llama_decode: log it once.
        def call(*args):
            batch = args[-1]
            depth = getattr(_depth, "value", 0)
            _depth.value = depth + 1
            start = time.monotonic()
            try:
                return real(*args)
            finally:
                _depth.value = depth
                if not depth:
                    seconds = time.monotonic() - start
                    n = batch.n_tokens
                    seqs = [batch.seq_id[i][0] for i in range(n)]
                    outputs = sum(1 for i in range(n) if batch.logits[i])
                    _out.write(f"{start:.6f} {seconds:.6f} {n} {outputs}"
                               f" {min(seqs, default=-1)} {max(seqs, default=-1)}\\n")
        return call

    _llama.llama_decode = _traced(_llama.llama_decode)
    _wake.decode_signalling = _traced(_wake.decode_signalling)
'''


@dataclass(frozen=True, slots=True)
class Call:
    """One model call: when it started (monotonic s), how long it ran, what it held."""

    start: float
    seconds: float
    tokens: int
    outputs: int
    first_seq: int
    last_seq: int


def read_trace(path: Path) -> list[Call]:
    """The calls a hook logged; a line cut short by a stopped server is skipped."""
    calls = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) != 6:
            continue
        calls.append(Call(float(fields[0]), float(fields[1]), *(int(f) for f in fields[2:])))
    return calls


def account(calls: Sequence[Call], start: float, end: float, streams: int) -> dict[str, float]:
    """A run's time (the calls that started in ``[start, end]``), in seconds and in steps.

    A step is the median duration of the run's full decode steps (``streams`` rows, each
    an output). Raises ValueError when the run has none to measure the step by.
    """
    run = [c for c in calls if start <= c.start <= end]
    full = [c.seconds for c in run if c.tokens == streams and c.outputs == streams]
    if not full:
        raise ValueError(f"no full decode step ({streams} rows) in the run")
    step = statistics.median(full)
    inside = sum(c.seconds for c in run)
    prompt = [c for c in run if c.tokens > c.outputs]
    partial = [c for c in run if c.tokens == c.outputs and c.tokens < streams]
    return {
        "step_ms": step * 1e3,
        "calls": len(run),
        "span_steps": (end - start) / step,
        "inside_steps": inside / step,
        "outside_steps": (end - start - inside) / step,
        "full_calls": len(full),
        "prompt_calls": len(prompt),
        "prompt_steps": sum(c.seconds for c in prompt) / step,
        "prompt_tokens": sum(c.tokens for c in prompt),
        "partial_calls": len(partial),
        "partial_steps": sum(c.seconds for c in partial) / step,
    }


def build_shim(directory: Path) -> Path:
    """Compile the llama-server shim into ``directory``; OSError without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) found")
    source, library = directory / "decode_trace.c", directory / "decode_trace.so"
    source.write_text(SHIM_SOURCE, encoding="utf-8")
    result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library),
                             str(source), "-ldl"],
                            capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise OSError(f"{compiler} failed: {result.stderr.strip()[:400]}")
    return library


def write_hook(directory: Path) -> Path:
    """Write skippyd's hook (a ``sitecustomize`` module) into ``directory``."""
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE_SOURCE, encoding="utf-8")
    return directory


def start_traced(setup: Setup, side: str, trace: Path, hooks: Path) -> ServerProcess:
    env = {"XDG_RUNTIME_DIR": str(setup.workdir), TRACE_ENV: str(trace)}
    if side == "llama-server":
        assert setup.llama_server is not None
        env["LD_PRELOAD"] = str(hooks / "decode_trace.so")
        argv = [str(setup.llama_server), "-m", str(setup.model), "-np", str(setup.lanes),
                "-c", str(setup.ctx), "-t", str(setup.threads), "-tb", str(setup.threads),
                "--host", "127.0.0.1", "--port", str(free_port())]
        return ServerProcess(argv, LLAMA_SERVER_READY, name=side, env=env).start()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    return skippyd_process(str(skippyd_config(setup, "skippyd", None)), env=env).start()


def run(setup: Setup, sides: Sequence[str], workload: str, rounds: int,
        requests: int | None = None) -> dict[str, list[dict[str, float]]]:
    """Every counted run's figures (see :func:`account`), per side."""
    streams, default_requests = WORKLOADS[workload]
    requests = requests or default_requests
    hooks = write_hook(setup.workdir)
    if "llama-server" in sides:
        build_shim(hooks)
    traces = {side: setup.workdir / f"{side}.trace" for side in sides}
    procs: dict[str, ServerProcess] = {}
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    try:
        for side in sides:
            procs[side] = start_traced(setup, side, traces[side], hooks)
        windows: dict[str, list[tuple[float, float, float, int]]] = {s: [] for s in sides}
        for r in range(rounds + 1):  # round 0 warms both up and is not counted
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for i, side in enumerate(order + order[::-1]):
                m = asyncio.run(closed_loop(procs[side], side, streams=streams, requests=requests,
                                            prompt_words=60, output_tokens=64,
                                            seed=f"{workload}:{r}:{i // len(sides)}"))
                if r:
                    assert m.window is not None  # one run, not a mean
                    windows[side].append((*m.window, m.figures["output_tok_s"], m.errors))
        for side in sides:
            calls = read_trace(traces[side])
            for start, end, tok_s, errors in windows[side]:
                figures = account(calls, start, end, streams)
                figures.update(output_tok_s=tok_s, errors=errors)
                results[side].append(figures)
    finally:
        for proc in procs.values():
            proc.stop()
    return results


ROWS = [("output_tok_s", "output tok/s", "{:.1f}"), ("step_ms", "full decode step, ms", "{:.2f}"),
        ("span_steps", "run span, steps", "{:.1f}"), ("inside_steps", "  inside calls", "{:.1f}"),
        ("outside_steps", "  outside calls", "{:.1f}"), ("calls", "calls", "{:.0f}"),
        ("full_calls", "  full decode steps", "{:.0f}"),
        ("prompt_calls", "  with prompt tokens", "{:.0f}"),
        ("prompt_steps", "    their time, steps", "{:.1f}"),
        ("prompt_tokens", "    their tokens", "{:.0f}"),
        ("partial_calls", "  partial decode steps", "{:.0f}"),
        ("partial_steps", "    their time, steps", "{:.1f}"), ("errors", "request errors", "{:.0f}")]


def print_results(results: dict[str, list[dict[str, float]]], workload: str) -> None:
    table = Table(title=f"{workload}: medians over runs (a step: the run's median full"
                        " decode step)")
    table.add_column("figure")
    for side in results:
        table.add_column(side, justify="right")
    for key, label, fmt in ROWS:
        values = [statistics.median(f[key] for f in runs) if key != "errors"
                  else sum(f[key] for f in runs) for runs in results.values()]
        table.add_row(label, *(fmt.format(v) for v in values))
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama-server binary (without it only skippyd is measured)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="streams8")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds after a warm-up round; each runs A-B-B-A")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default: 32 for streams8, 6 for stream1)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra skippyd config (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sides = ["skippyd"] + (["llama-server"] if args.llama_server else [])
    with tempfile.TemporaryDirectory(prefix="decode-calls-") as tmp:
        setup = Setup(args.model or Path(default_model_path()), args.threads, 8, 8192,
                      args.llama_server, Path(tmp), _parse_sets(args.set))
        try:
            results = run(setup, sides, args.workload, args.rounds, args.requests)
        except (OSError, ValueError) as exc:  # no C compiler for the shim; a run to account
            console.print(f"[red]decode_calls: {exc}[/]")
            return 2
    print_results(results, args.workload)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 1 if any(f["errors"] for runs in results.values() for f in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
