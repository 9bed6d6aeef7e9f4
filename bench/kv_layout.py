"""What the KV cache's layout and element type cost a decode step.

A bare ``llama_decode`` loop, no scheduler: ``--lanes`` sequences each prefilled with
``--prompt-tokens`` tokens, then decoded together one row each for ``--steps`` steps, in
a context of ``--ctx`` cells. ``--compare layout`` (the default) puts them in one pool
all sequences share (``kv_unified``) against one stream per sequence; ``--compare cache``
keeps the pool and compares the KV element types ``f16``, ``q8_0`` and ``q4_0`` (flash
attention on, which the quantized types need). The variants alternate for ``--rounds``
rounds in one process; the report is each one's median step time, its decode tok/s, its
KV bytes per token, and its step time against the first variant's.

In a unified pool every row's attention spans the cells up to the highest one in use, so
the cost grows with what the pool holds; with a stream per lane each row sees only its
own. A quantized cache holds a token in fewer bytes and costs some dequantizing.

    python bench/kv_layout.py [--model PATH] [--compare layout|cache] [--lanes 8]
        [--prompt-tokens 120] [--ctx 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.bench.models import add_model_option, model_path
from skippyd.config.schema import CACHE_TYPE_BYTES, FLASH_ATTN_TYPE_IDS, GGML_TYPE_IDS
from skippyd.engine.runtime.llama_ext import ensure_backend
from skippyd.model_files.model_info import inspect_model


@dataclass(frozen=True)
class Variant:
    """One way to build the context."""

    name: str
    unified: bool = True
    cache_type: str = "f16"


VARIANTS = {
    "layout": (Variant("unified"), Variant("per_lane", unified=False)),
    "cache": (Variant("f16"), Variant("q8_0", cache_type="q8_0"),
              Variant("q4_0", cache_type="q4_0")),
}


def step_times(model, args: argparse.Namespace, variant: Variant, rng: np.random.Generator,
               n_vocab: int) -> list[float]:
    params = L.llama_context_default_params()
    params.n_ctx = args.ctx
    params.n_batch = max(args.lanes * args.prompt_tokens, 512)
    params.n_ubatch = 512
    params.n_seq_max = args.lanes
    params.kv_unified = variant.unified
    params.type_k = params.type_v = GGML_TYPE_IDS[variant.cache_type]
    if args.compare == "cache":
        params.flash_attn_type = FLASH_ATTN_TYPE_IDS["enabled"]
    params.n_threads = params.n_threads_batch = args.threads
    params.no_perf = True
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"cannot create a context of {args.ctx} cells ({variant.name})")
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
    parser.add_argument("--compare", choices=tuple(VARIANTS), default="layout")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ensure_backend()
    path = model_path(args)
    values_per_token = inspect_model(path).kv_values_per_token()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = L.llama_model_load_from_file(os.fsencode(str(path)), mparams)
    if not model:
        raise SystemExit(f"cannot load {path}")
    n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
    rng = np.random.default_rng(0)
    variants = VARIANTS[args.compare]
    medians: dict[str, list[float]] = {variant.name: [] for variant in variants}
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            times = step_times(model, args, variant, rng, n_vocab)
            medians[variant.name].append(statistics.median(times[2:]) * 1000)
            print(f"round {round_index + 1} {variant.name:8s} "
                  f"{medians[variant.name][-1]:7.2f} ms/step", file=sys.stderr)
    L.llama_model_free(model)
    base = variants[0].name
    rows = []
    for variant in variants:
        ratios = [v / b for v, b in zip(medians[variant.name], medians[base], strict=True)]
        step_ms = statistics.median(medians[variant.name])
        rows.append({"variant": variant.name, "step_ms": step_ms,
                     "decode_tok_s": args.lanes / step_ms * 1000,
                     "kv_bytes_per_token": round(values_per_token
                                                 * CACHE_TYPE_BYTES[variant.cache_type]),
                     f"ratio_to_{base}": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)]})
    print(f"{path.name}: {args.lanes} rows at {args.prompt_tokens} tokens each, ctx {args.ctx}")
    for row in rows:
        print(f"  {row['variant']:8s} {row['step_ms']:7.2f} ms/step  "
              f"{row['decode_tok_s']:6.1f} tok/s  {row['kv_bytes_per_token'] / 1024:6.1f} KiB/token"
              f"  x{row[f'ratio_to_{base}']:.3f} of {base} "
              f"({row['ratio_range'][0]:.3f}-{row['ratio_range'][1]:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "compare": args.compare,
                                         "lanes": args.lanes,
                                         "prompt_tokens": args.prompt_tokens, "ctx": args.ctx,
                                         "threads": args.threads, "variants": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
