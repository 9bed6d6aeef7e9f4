"""What cutting a prompt into chunks costs: one prompt prefilled in chunks of several sizes.

The step-time budget prefills a long prompt in chunks beside the running streams' decode
rows (``docs/scheduler.md``, "The step-time budget"). Each chunk is a ``llama_decode``
call of its own, and on a CPU every call passes over the model's weights whatever its
size, so the chunk size decides how much prompt speed the streams' short gaps cost. This
script prefills one prompt of ``--prompt-tokens`` tokens on a bare llama.cpp context, as
one call and in chunks of each ``--chunks`` size, every call also carrying one decode row
for each of ``--decoders`` other sequences (as a budgeted step does). Sizes are run in
alternating order, ``--reps`` times, and each time is a median.

A chunked run makes more calls, so its decode rows produce more tokens: the "prompt
time" column takes out the extra calls' decode rows at the measured time of a step of
decode rows alone, which is what those tokens would have cost without the prompt. Its
ratio to one call is the price of the chunking itself::

    python bench/chunk_cost.py [--model PATH] [--threads 2] [--prompt-tokens 504]
        [--decoders 4] [--chunks 65,72,96,126,168,252] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from llama_cpp import llama_cpp as L
from rich.console import Console
from rich.table import Table

from skippyd.bench.runtime import decode_or_raise
from skippyd.config import default_model_path
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions

console = Console()

#: Prompt tokens each decoding sequence holds before the measurement.
DECODER_CONTEXT = 60


class ChunkBench:
    """A llama.cpp context with one prompt sequence (0) and ``decoders`` more (1..n)."""

    def __init__(self, runtime: LlamaRuntime, decoders: int) -> None:
        self._ctx = runtime.context
        self._memory = L.llama_get_memory(self._ctx)
        self._decoders = decoders
        self._batch = L.llama_batch_init(4096, 0, 1)
        self._positions = [0] * decoders
        self._vocab = runtime.n_vocab

    def close(self) -> None:
        L.llama_batch_free(self._batch)

    def _add(self, index: int, token: int, position: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[index] = token % self._vocab  # any valid id will do
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq
        batch.logits[index] = logits

    def _call(self, count: int) -> float:
        self._batch.n_tokens = count
        started = time.perf_counter()
        decode_or_raise(self._ctx, self._batch)
        return time.perf_counter() - started

    def reset(self) -> None:
        """Empty every sequence, then give each decoder its context."""
        for seq in range(self._decoders + 1):
            L.llama_memory_seq_rm(self._memory, seq, -1, -1)
        for d in range(self._decoders):
            for i in range(DECODER_CONTEXT):
                self._add(i, 300 + i, i, 1 + d, i == DECODER_CONTEXT - 1)
            self._call(DECODER_CONTEXT)
        self._positions = [DECODER_CONTEXT] * self._decoders

    def _decode_rows(self) -> int:
        for d in range(self._decoders):
            self._add(d, 200 + d, self._positions[d], 1 + d, True)
            self._positions[d] += 1
        return self._decoders

    def prefill(self, prompt_tokens: int, chunk: int, salt: int) -> tuple[float, int]:
        """Seconds inside ``llama_decode`` for the whole prompt, and the calls made."""
        self.reset()
        seconds, calls = 0.0, 0
        for start in range(0, prompt_tokens, chunk):
            count = self._decode_rows()
            for i in range(start, min(prompt_tokens, start + chunk)):
                self._add(count, 100 + (i * 37 + salt) % 30000, i, 0, i == prompt_tokens - 1)
                count += 1
            seconds += self._call(count)
            calls += 1
        return seconds, calls

    def decode_step(self, steps: int = 10) -> float:
        """Median seconds of a call with the decode rows alone."""
        self.reset()
        times = []
        for _ in range(steps):
            times.append(self._call(self._decode_rows()))
        return statistics.median(times)


def measure(model: Path, threads: int, prompt_tokens: int, decoders: int,
            chunks: Sequence[int], reps: int) -> tuple[float, dict[int, tuple[float, int]]]:
    """The decode step's time and, per chunk size, (median seconds, calls)."""
    options = RuntimeOptions(str(model), lane_count=decoders + 1, ctx_size=8192,
                             n_batch=4096, n_ubatch=512, threads=threads)
    sizes = [prompt_tokens, *chunks]
    times: dict[int, list[float]] = {size: [] for size in sizes}
    calls: dict[int, int] = {}
    steps: list[float] = []
    with LlamaRuntime(options) as runtime:
        bench = ChunkBench(runtime, decoders)
        try:
            bench.prefill(prompt_tokens, prompt_tokens, 0)  # warm-up
            for rep in range(reps):
                for size in sizes if rep % 2 == 0 else sizes[::-1]:
                    seconds, calls[size] = bench.prefill(prompt_tokens, size, rep)
                    times[size].append(seconds)
                if decoders:
                    steps.append(bench.decode_step())
        finally:
            bench.close()
    step = statistics.median(steps) if steps else 0.0
    return step, {size: (statistics.median(times[size]), calls[size]) for size in sizes}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=504)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--chunks", default="65,72,96,126,168,252",
                        help="chunk sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        args.chunk_sizes = sorted({int(c) for c in args.chunks.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--chunks: not a list of integers: {args.chunks!r}")
    if not args.chunk_sizes or min(args.chunk_sizes) < 1:
        parser.error("--chunks: give one or more sizes of at least 1")
    if args.prompt_tokens < 2 or args.prompt_tokens > 4000:
        parser.error("--prompt-tokens: between 2 and 4000")
    if not 0 <= args.decoders <= 15:
        parser.error("--decoders: between 0 and 15")
    if args.reps < 1:
        parser.error("--reps: at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or Path(default_model_path())
    step, results = measure(model, args.threads, args.prompt_tokens, args.decoders,
                            args.chunk_sizes, args.reps)
    whole, _ = results[args.prompt_tokens]
    table = Table(title=f"a {args.prompt_tokens}-token prompt beside {args.decoders} decode"
                        f" rows, {args.threads} threads (medians of {args.reps})")
    for column in ("chunk", "calls", "time", "prompt time", "ratio to one call"):
        table.add_column(column, justify="right")
    for size, (seconds, calls) in sorted(results.items(), reverse=True):
        prompt_s = seconds - (calls - 1) * step
        table.add_row("one call" if size == args.prompt_tokens else str(size), str(calls),
                      f"{seconds * 1e3:.0f} ms", f"{prompt_s * 1e3:.0f} ms",
                      f"{prompt_s / whole:.3f}")
    console.print(table)
    if args.decoders:
        console.print(f"a step of the {args.decoders} decode rows alone: {step * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
