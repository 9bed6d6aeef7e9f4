"""What the KV layout costs a decode step: one unified pool against one stream per lane.

A bare ``llama_decode`` loop, no scheduler: ``--lanes`` sequences each prefilled with
``--prompt-tokens`` tokens, then decoded together one row each for ``--steps`` steps, in
a context of ``--ctx`` cells either shared by all sequences (``kv_unified``) or split
into one stream per sequence. The two layouts alternate for ``--rounds`` rounds in one
process; the report is the median step time of each and their ratio. In a unified pool
every row's attention spans the cells up to the highest one in use, so the cost grows
with what the pool holds; with a stream per lane each row sees only its own.

    python bench/kv_layout.py [--model PATH] [--lanes 8] [--prompt-tokens 120] [--ctx 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.bench.models import add_model_option, model_path
from skippyd.engine.runtime.llama_ext import ensure_backend


def step_times(model, args: argparse.Namespace, unified: bool, rng: np.random.Generator,
               n_vocab: int) -> list[float]:
    params = L.llama_context_default_params()
    params.n_ctx = args.ctx
    params.n_batch = max(args.lanes * args.prompt_tokens, 512)
    params.n_ubatch = 512
    params.n_seq_max = args.lanes
    params.kv_unified = unified
    params.n_threads = params.n_threads_batch = args.threads
    params.no_perf = True
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"cannot create a context of {args.ctx} cells")
    batch = L.llama_batch_init(params.n_batch, 0, 1)
    try:
        def decode(rows: list[tuple[int, int, int, bool]]) -> None:
            batch.n_tokens = len(rows)
            for i, (token, pos, seq, logits) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed (is --ctx large enough?)")

        for seq in range(args.lanes):
            tokens = rng.integers(100, n_vocab, args.prompt_tokens)
            for start in range(0, args.prompt_tokens, 256):
                part = tokens[start:start + 256]
                decode([(int(t), start + i, seq, start + i == args.prompt_tokens - 1)
                        for i, t in enumerate(part)])
        times = []
        for step in range(args.steps):
            rows = [(int(rng.integers(100, n_vocab)), args.prompt_tokens + step, seq, True)
                    for seq in range(args.lanes)]
            began = time.perf_counter()
            decode(rows)
            times.append(time.perf_counter() - began)
        return times
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ensure_backend()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    path = model_path(args)
    model = L.llama_model_load_from_file(os.fsencode(str(path)), mparams)
    if not model:
        raise SystemExit(f"cannot load {path}")
    n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
    rng = np.random.default_rng(0)
    medians: dict[str, list[float]] = {"unified": [], "per_lane": []}
    for round_index in range(args.rounds):
        order = ("unified", "per_lane") if round_index % 2 == 0 else ("per_lane", "unified")
        for layout in order:
            times = step_times(model, args, layout == "unified", rng, n_vocab)
            medians[layout].append(statistics.median(times[2:]) * 1000)
            print(f"round {round_index + 1} {layout:8s} {medians[layout][-1]:7.2f} ms/step",
                  file=sys.stderr)
    L.llama_model_free(model)
    ratios = [u / p for u, p in zip(medians["unified"], medians["per_lane"], strict=True)]
    result = {"model": str(path), "lanes": args.lanes, "prompt_tokens": args.prompt_tokens,
              "ctx": args.ctx, "threads": args.threads,
              "unified_ms": statistics.median(medians["unified"]),
              "per_lane_ms": statistics.median(medians["per_lane"]),
              "ratio_unified_per_lane": statistics.median(ratios),
              "ratio_range": [min(ratios), max(ratios)]}
    print(f"{path.name}: {args.lanes} rows at {args.prompt_tokens} tokens each, ctx {args.ctx}: "
          f"unified {result['unified_ms']:.2f} ms, per lane {result['per_lane_ms']:.2f} ms, "
          f"unified / per lane {result['ratio_unified_per_lane']:.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
