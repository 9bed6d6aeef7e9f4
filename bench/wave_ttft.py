"""When each request of a closed-loop run got its first token, skippyd against llama-server.

``vs_llama_server.py`` reports a median time to first token; in its ``streams8``
workload (8 streams restarting as soon as their answer ends, every answer of one length)
that median is set by how each server takes a *wave*: prompts that arrive together. This
prints every request of one such run on each server: when it was sent, its time to first
token, and when that token came (all from the run's start), so the waves and how each
server split them can be read off directly::

    python bench/wave_ttft.py --llama-server PATH/TO/llama-server [--model 1b.gguf]
        [--streams 8] [--requests 16] [--output-tokens 32] [--set runtime.KEY=VALUE]

Both servers run with the same threads, lanes (one per stream) and KV layout as in
``vs_llama_server.py``; each run gets prompts of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_server import (  # noqa: E402  (a sibling script, not a package)
    Setup,
    _parse_sets,
    _target,
    start_server,
    stop_server,
)

from skippyd.bench.loadgen import RequestRecord, make_client, run_level  # noqa: E402
from skippyd.bench.process import ServerProcess  # noqa: E402
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level  # noqa: E402
from skippyd.config import default_model_path  # noqa: E402


async def one_run(proc: ServerProcess, name: str, args: argparse.Namespace,
                  seed: str) -> list[RequestRecord]:
    spec = WorkloadSpec(concurrency=(args.streams,), num_requests=args.requests,
                        prompt_words=IntRange(args.prompt_words, args.prompt_words),
                        output_tokens=IntRange(args.output_tokens, args.output_tokens),
                        seed=zlib.crc32(seed.encode()))
    async with make_client(args.streams) as client:
        target = await _target(client, proc, name)
        level = await run_level(client, target, build_level(spec, 0), args.streams,
                                temperature=0.0, timeout_s=900.0, on_done=lambda r: None)
    return sorted(level.records, key=lambda r: r.sent_s)


def report(name: str, records: list[RequestRecord]) -> None:
    print(f"{name}: sent, time to first token, first token at (s from the run's start)")
    for record in records:
        if not record.ok or record.ttft_s is None:
            print(f"  {record.sent_s:8.3f}  failed: {record.error} {record.error_detail}")
            continue
        print(f"  {record.sent_s:8.3f}  {record.ttft_s:7.3f}  {record.sent_s + record.ttft_s:8.3f}")
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    if ttfts:
        print(f"  median time to first token {statistics.median(ttfts):.3f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="the llama-server binary (without it, skippyd alone)")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="an extra skippyd config key (repeatable)")
    args = parser.parse_args()
    for name in ("threads", "streams", "requests", "prompt_words", "output_tokens", "ctx"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    servers = ["skippyd"] + (["llama-server"] if args.llama_server else [])
    with tempfile.TemporaryDirectory(prefix="skippyd-waves-") as workdir:
        setup = Setup(model=(args.model or default_model_path()).resolve(),
                      threads=args.threads, lanes=args.streams, ctx=args.ctx,
                      llama_server=args.llama_server, workdir=Path(workdir),
                      skippyd_extra=_parse_sets(args.set))
        for index, server in enumerate(servers):
            proc = start_server(setup, server)
            try:
                report(server, asyncio.run(one_run(proc, server, args, f"waves{index}")))
            finally:
                stop_server(proc, server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
