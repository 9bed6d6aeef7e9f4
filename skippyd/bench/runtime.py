"""Runtime overhead benchmark: ``run_iteration`` against a bare llama_decode loop.

Both run on the same llama.cpp context in the same process, alternating, so the ratio
measures only what skippyd's runtime adds (batch filling, validation, per-session
sampler chains) on top of llama.cpp. Run::

    python -m skippyd.bench.runtime [--model PATH] [--threads 2] [--steps 48]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from llama_cpp import llama_cpp as L
from rich.console import Console
from rich.table import Table

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions

GREEDY = SamplingConfig(temperature=0.0)
PROMPT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class RuntimeBenchRow:
    batch: int
    skippyd_tok_s: float
    bare_tok_s: float

    @property
    def ratio(self) -> float:
        return self.skippyd_tok_s / self.bare_tok_s if self.bare_tok_s else 0.0


def _prompt(seq: int) -> list[int]:
    # Distinct, in-vocabulary prompts per sequence (token ids are arbitrary but valid).
    return [(1000 + 37 * seq + 11 * i) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def skippyd_decode_rate(rt: LlamaRuntime, batch: int, steps: int) -> float:
    """Decode tok/s through ``run_iteration`` (greedy, one sample per session)."""
    ids = [f"bench-{i}" for i in range(batch)]
    out = rt.run_iteration(
        [IterationRequest(s, _prompt(i), sampling=GREEDY, sample_last=True) for i, s in enumerate(ids)]
    )
    last = {ids[s.request_index]: s.token for s in out.samples}
    started = time.perf_counter()
    for _ in range(steps):
        out = rt.run_iteration([
            IterationRequest(s, [last[s]], sampling=GREEDY, sample_last=True,
                             phase=RowPhase.DECODE)
            for s in ids
        ])
        for sample in out.samples:
            last[ids[sample.request_index]] = sample.token
    elapsed = time.perf_counter() - started
    for s in ids:
        rt.drop_session(s)
    return batch * steps / elapsed


def median_decode_step_s(model_path: str, *, batch: int = 8, steps: int = 32,
                         threads: int = 2) -> float:
    """Median wall time of one ``batch``-sequence decode step of the real runtime."""
    options = RuntimeOptions(model_path, lane_count=batch, ctx_size=4096, n_batch=512,
                             n_ubatch=512, threads=threads)
    with LlamaRuntime(options) as rt:
        ids = [f"step-{i}" for i in range(batch)]
        out = rt.run_iteration([
            IterationRequest(s, _prompt(i), sampling=GREEDY, sample_last=True)
            for i, s in enumerate(ids)
        ])
        last = {ids[s.request_index]: s.token for s in out.samples}
        durations = []
        for _ in range(steps):
            requests = [IterationRequest(s, [last[s]], sampling=GREEDY, sample_last=True,
                                         phase=RowPhase.DECODE) for s in ids]
            started = time.perf_counter()
            out = rt.run_iteration(requests)
            durations.append(time.perf_counter() - started)
            last.update({ids[s.request_index]: s.token for s in out.samples})
    return statistics.median(durations)


def decode_or_raise(ctx, llama_batch) -> None:
    """``llama_decode``, raising RuntimeError on a non-zero code."""
    code = L.llama_decode(ctx, llama_batch)
    if code != 0:  # no logits then: sampling them would abort the process
        raise RuntimeError(f"llama_decode returned {code}")


def bare_decode_rate(rt: LlamaRuntime, batch: int, steps: int) -> float:
    """The same work as a minimal hand-written loop over the raw llama.cpp API."""
    ctx, mem = rt.context, L.llama_get_memory(rt.context)
    llama_batch = L.llama_batch_init(max(batch * PROMPT_TOKENS, batch), 0, 1)
    greedy = L.llama_sampler_init_greedy()
    try:
        for seq in range(batch):  # a lane the runtime used may still hold its cells
            L.llama_memory_seq_rm(mem, seq, -1, -1)
        n = 0
        for seq in range(batch):
            for i, token in enumerate(_prompt(seq)):
                llama_batch.token[n], llama_batch.pos[n] = token, i
                llama_batch.n_seq_id[n], llama_batch.seq_id[n][0] = 1, seq
                llama_batch.logits[n] = i == PROMPT_TOKENS - 1
                n += 1
        llama_batch.n_tokens = n
        decode_or_raise(ctx, llama_batch)
        last = [L.llama_sampler_sample(greedy, ctx, (s + 1) * PROMPT_TOKENS - 1) for s in range(batch)]
        started = time.perf_counter()
        for step in range(steps):
            for seq in range(batch):
                llama_batch.token[seq], llama_batch.pos[seq] = last[seq], PROMPT_TOKENS + step
                llama_batch.n_seq_id[seq], llama_batch.seq_id[seq][0] = 1, seq
                llama_batch.logits[seq] = True
            llama_batch.n_tokens = batch
            decode_or_raise(ctx, llama_batch)
            last = [L.llama_sampler_sample(greedy, ctx, seq) for seq in range(batch)]
        elapsed = time.perf_counter() - started
    finally:
        for seq in range(batch):
            L.llama_memory_seq_rm(mem, seq, -1, -1)
        L.llama_sampler_free(greedy)
        L.llama_batch_free(llama_batch)
    return batch * steps / elapsed


def run_runtime_bench(model_path: str, *, threads: int, steps: int, rounds: int = 3,
                      batches: tuple[int, ...] = (1, 2, 4, 8)) -> list[RuntimeBenchRow]:
    """Median of ``rounds`` alternating measurements per batch size."""
    options = RuntimeOptions(model_path, lane_count=max(batches), ctx_size=4096,
                             n_batch=512, n_ubatch=512, threads=threads)
    rows = []
    with LlamaRuntime(options) as rt:
        skippyd_decode_rate(rt, 1, 4)  # warm-up: first decodes allocate buffers
        for batch in batches:
            ours, bare = [], []
            for _ in range(rounds):
                bare.append(bare_decode_rate(rt, batch, steps))
                ours.append(skippyd_decode_rate(rt, batch, steps))
            rows.append(RuntimeBenchRow(batch, statistics.median(ours), statistics.median(bare)))
    return rows


def runtime_table(rows: list[RuntimeBenchRow]) -> Table:
    table = Table(title="Decode throughput: skippyd runtime vs bare llama_decode loop")
    for column in ("batch", "skippyd tok/s", "bare tok/s", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row.batch), f"{row.skippyd_tok_s:.1f}", f"{row.bare_tok_s:.1f}",
                      f"{row.ratio:.3f}")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.model is None:
        from skippyd.config import default_model_path

        args.model = str(default_model_path())
    rows = run_runtime_bench(args.model, threads=args.threads, steps=args.steps, rounds=args.rounds)
    Console().print(runtime_table(rows))


if __name__ == "__main__":
    main()
