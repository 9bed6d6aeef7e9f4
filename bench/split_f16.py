"""Float16 activation rows against float32: link bytes and greedy-token agreement.

Runs the model (SmolLM2 by default) split in two (layers 0-17 and 17-30 of SmolLM2) in
one process, stage 1's input rows passing through the real stage-link codec
(``encode_iteration`` / ``decode_stream``) as float32 or as float16
(``link.activation_dtype``). For a fixed prompt set it
generates ``--tokens`` greedy tokens each way and reports how many generated tokens
agree before the first difference, how many prompts agree completely, and the
ITERATION bytes per row. float32 rows are exact (the chain equals the unsplit model);
float16 rows are not, and this measures by how much.

    python bench/split_f16.py [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from skippyd.bench.models import add_model_option, layer_bounds, model_layers, model_path
from skippyd.engine.runtime.contract import IterationRequest, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.pipeline_types import ChainEntry
from skippyd.engine.runtime.tokenizer import Tokenizer
from skippyd.link.wire import LinkLimits, decode_stream, encode_iteration
from skippyd.model_files.slice import cached_slice

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# compute the mean of",
    "The largest planet in the solar system is",
    "Monday, Tuesday, Wednesday,",
    "Photosynthesis is the process by which",
    "A haiku about the sea:",
    "The quick brown fox",
    "In 1969, the first humans",
    "SELECT name FROM users WHERE",
    "The French word for cat is",
    "Here is a list of fruits: apple, banana,",
]


def generate(stages: list[LlamaRuntime], prompt: list[int], steps: int, half: bool,
             n_embd: int) -> tuple[list[int], int, int]:
    """Greedy tokens through both stages; returns (tokens, row bytes sent, rows sent)."""
    limits = LinkLimits(max_frame_bytes=1 << 30, row_width=n_embd)
    tokens, generated, sent, rows = list(prompt), [], 0, 0
    feed = list(prompt)
    for _ in range(steps):
        first = stages[0].run_iteration([IterationRequest("s", feed)])
        entry = ChainEntry(session_id=1, first_position=len(tokens) - len(feed),
                           token_ids=feed, rows=first.output_rows[0])
        frame = encode_iteration(1, entry, end_of_batch=True, half_rows=half)
        sent, rows = sent + len(frame), rows + len(feed)
        received = decode_stream(frame, limits)[0].payload.rows
        out = stages[1].run_iteration([IterationRequest(
            "s", feed, input_rows=received, sampling=GREEDY, sample_last=True)])
        token = out.samples[0].token
        generated.append(token)
        tokens.append(token)
        feed = [token]
    for stage in stages:
        stage.drop_session("s")
    return generated, sent, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    add_model_option(parser)
    args = parser.parse_args(argv)
    model = model_path(args)
    n_layer = model_layers(model)
    split_at = layer_bounds(n_layer, 2)[1]
    tokenizer = Tokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [cached_slice(model, 0, split_at, tmp), cached_slice(model, split_at, n_layer, tmp)]
        stages = [LlamaRuntime(RuntimeOptions(str(path), lane_count=1, ctx_size=512,
                                              n_batch=256, n_ubatch=256, threads=1,
                                              first_stage=i == 0,
                                              final_stage=i == 1))
                  for i, path in enumerate(paths)]
        n_embd = stages[0].n_embd
        rows = []
        for prompt in PROMPTS:
            ids = tokenizer.tokenize(prompt, add_special=True)
            full, full_bytes, count = generate(stages, ids, args.tokens, False, n_embd)
            half, half_bytes, _ = generate(stages, ids, args.tokens, True, n_embd)
            agree = next((i for i, (a, b) in enumerate(zip(full, half, strict=True)) if a != b),
                         len(full))
            rows.append({"prompt": prompt, "agree": agree, "tokens": len(full),
                         "f32_bytes_per_row": full_bytes / count,
                         "f16_bytes_per_row": half_bytes / count})
            print(f"{agree:3d}/{len(full)} agree  {prompt!r}")
        for stage in stages:
            stage.close()
    tokenizer.close()
    total = sum(r["tokens"] for r in rows)
    agreed = sum(r["agree"] for r in rows)
    exact = sum(r["agree"] == r["tokens"] for r in rows)
    f32 = sum(r["f32_bytes_per_row"] for r in rows) / len(rows)
    f16 = sum(r["f16_bytes_per_row"] for r in rows) / len(rows)
    print(f"float16 rows: {agreed}/{total} generated tokens ({agreed / total:.1%}) agree with "
          f"float32 before the first difference; {exact}/{len(rows)} prompts agree "
          f"completely; {f16:.0f} vs {f32:.0f} ITERATION bytes per row ({f16 / f32:.2f}x)")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "agreed": agreed, "total": total,
                                         "exact": exact}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
