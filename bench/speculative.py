"""Speculative decoding: what drafting gains where answers repeat, and costs where not.

The script starts every server itself: skippyd with ``[speculative] mode = "ngram"``,
skippyd with it off, and (given ``--llama-server``) llama.cpp's own server with
``--spec-type ngram-mod``, all on the same model, threads and lanes. Each round starts
them afresh (the start order alternating), then runs every workload at every stream count
on each side in the order A, B, C, C, B, A, each pass with prompts of its own (the same
for every side); a side's figure in a round is the mean of its two passes, and the
verdicts take the median over rounds of each round's ratio. Any request error is NOT MET.

Workloads (greedy, ``--max-tokens`` output tokens, chat completions):

* ``copy``: a real Python function from the standard library with the instruction to
  rename one of its variables and reply with the whole function: the answer repeats
  most of the prompt, the case drafting is for.
* ``free``: a short story about a subject of its own: little of the answer repeats.

Targets, as ratios of output tok/s: ``copy`` at 1 stream on the embedded model, one
machine, ngram >= 1.3x skippyd off and >= 1.0x llama-server with ngram-mod; everything
else (``free``, 8 streams, another ``--model`` such as the random-weight shapes, a split)
>= 0.98x skippyd off (drafting must notice when it cannot pay). Acceptance is reported from each
server's response (skippyd's ``usage.completion_tokens_details``, llama-server's
``timings``).

``--stages N`` (with ``--rtt-ms``) serves both skippyd sides as a split pipeline of N
stages, one core and one thread each, pinned as ``bench/split_machines.py`` pins them,
every link through the link shaper at that round trip: stage 0 drafts, the final stage
verifies. llama-server has no split, so it is left out there.

    python bench/speculative.py [--llama-server PATH] [--model PATH] [--streams 1,8]
        [--workloads copy,free] [--rounds 3] [--max-tokens 256]
        [--stages 2 --rtt-ms 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib
import inspect
import itertools
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from skippyd.bench.models import add_model_option, layer_bounds, model_path
from skippyd.bench.process import ServerProcess, free_port, skippyd_process
from skippyd.model_files.model_info import inspect_model

console = Console(width=None if Console().is_terminal else 140)
LLAMA_SERVER_READY = r"listening on (?P<url>http://\S+)"
SIDES = ("skippyd ngram", "skippyd off", "llama-server ngram-mod")
WORKLOADS = ("copy", "free")
#: Standard-library modules whose functions make the copy workload's prompts.
SOURCE_MODULES = ("textwrap", "difflib", "shlex", "string", "json.decoder", "json.encoder",
                  "heapq", "ipaddress", "pprint", "statistics", "fractions", "calendar",
                  "csv", "configparser", "argparse", "gettext", "tarfile", "zipfile",
                  "urllib.parse", "email.utils", "http.cookies", "inspect", "dataclasses",
                  "enum", "functools", "collections", "pathlib", "tokenize", "ast")
SUBJECTS = ("a lighthouse keeper", "a retired astronaut", "a clockmaker", "a young fox",
            "a ship's cook", "a librarian", "a mountain guide", "a street musician",
            "a beekeeper", "a chess prodigy", "a night-shift nurse", "a lost robot")
EVENTS = ("finds a letter", "loses a bet", "meets a stranger", "misses a train",
          "hears a song", "plants a tree", "opens a shop", "fixes a bridge")
PLACES = ("in the rain", "at dawn", "in a small village", "on a winter night",
          "by the sea", "in a busy city", "in the desert", "on an island")


# -- prompts -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Function:
    source: str
    old: str
    new: str


def standard_library_functions(lines: range = range(12, 41)) -> list[Function]:
    """Functions of :data:`SOURCE_MODULES` of ``lines`` lines with a local variable to
    rename, in a fixed order."""
    found: list[Function] = []
    for name in SOURCE_MODULES:
        module = importlib.import_module(name)
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError, SyntaxError):
            continue
        source = inspect.getsource(module).splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
                continue
            length = node.end_lineno - node.lineno + 1
            if length not in lines:
                continue
            names = sorted({t.id for t in ast.walk(node) if isinstance(t, ast.Name)
                            and isinstance(t.ctx, ast.Store) and len(t.id) >= 3})
            if not names:
                continue
            text = textwrap.dedent("\n".join(source[node.lineno - 1:node.end_lineno]))
            old = names[0]
            found.append(Function(text, old, f"{old}_renamed"))
    return found


def copy_prompt(function: Function) -> list[dict[str, str]]:
    return [{"role": "user", "content":
             f"Rename the variable `{function.old}` to `{function.new}` in this Python "
             "function. Reply with the whole function and nothing else.\n\n"
             f"```python\n{function.source}\n```"}]


def free_prompt(index: int) -> list[dict[str, str]]:
    subject, event, place = next(itertools.islice(
        itertools.product(SUBJECTS, EVENTS, PLACES), index % (12 * 8 * 8), None))
    return [{"role": "user", "content":
             f"Write a short story about {subject} who {event} {place}. (#{index})"}]


def prompts(workload: str, start: int, count: int,
            functions: Sequence[Function]) -> list[list[dict[str, str]]]:
    """``count`` prompts of ``workload`` from index ``start`` (unique per index)."""
    if workload == "copy":
        return [copy_prompt(functions[(start + i) % len(functions)]) for i in range(count)]
    return [free_prompt(start + i) for i in range(count)]


# -- servers -----------------------------------------------------------------------------

@dataclass
class Setup:
    model: Path
    threads: int
    lanes: int
    ctx: int
    llama_server: Path | None
    workdir: Path
    max_tokens: int
    stages: int = 1
    rtt_ms: float = 0.0


class SplitSide:
    """A skippyd side served as a pipeline of ``setup.stages`` pinned stages (see
    ``bench/split_machines.py``), every link through a shaper at ``setup.rtt_ms``."""

    def __init__(self, setup: Setup, mode: str, name: str) -> None:
        import split_machines  # a sibling script: python puts bench/ on the path

        workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=setup.workdir))
        # A request's context as on one server: its lane's share of --ctx.
        args = argparse.Namespace(model=str(setup.model), ctx=setup.ctx // setup.lanes,
                                  lanes=setup.lanes, cores_per_stage=1)

        class DraftingChain(split_machines.Chain):
            def config(self, i: int) -> Path:
                path = super().config(i)
                if i == 0:
                    path.write_text(path.read_text() + f'[speculative]\nmode = "{mode}"\n')
                return path

        cpus = sorted(os.sched_getaffinity(0))
        bounds = layer_bounds(inspect_model(setup.model).n_layer, setup.stages)
        self._stack = contextlib.ExitStack()
        try:
            self.chain = DraftingChain(
                workdir, args, bounds, split_machines.assign_cores(cpus, setup.stages, 1),
                workdir, shaped=setup.rtt_ms > 0).start(self._stack)
            if setup.rtt_ms > 0:
                self.chain.shape(setup.rtt_ms)
        except BaseException:
            self._stack.close()
            raise
        self.url = self.chain.url

    def stop(self) -> None:
        self._stack.close()


def start_side(setup: Setup, side: str) -> ServerProcess | SplitSide:
    if side.startswith("llama-server"):
        assert setup.llama_server is not None
        argv = [str(setup.llama_server), "-m", str(setup.model), "-np", str(setup.lanes),
                "-c", str(setup.ctx), "--no-kv-unified", "-t", str(setup.threads),
                "-tb", str(setup.threads), "--spec-type", "ngram-mod",
                "--host", "127.0.0.1", "--port", str(free_port())]
        return ServerProcess(argv, LLAMA_SERVER_READY, name=side).start()
    mode = side.split()[1]
    name = side.replace(" ", "-")
    if setup.stages > 1:
        return SplitSide(setup, mode, name)
    path = setup.workdir / f"{name}.toml"
    path.write_text(
        f'[stage]\nid = "{name}"\nmodel_path = "{setup.model}"\n'
        f"[runtime]\nlane_count = {setup.lanes}\nctx_size = {setup.ctx}\n"
        f'kv_layout = "per_lane"\n'
        f"threads = {setup.threads}\nthreads_batch = {setup.threads}\n"
        f'[speculative]\nmode = "{mode}"\n'
        f'[control]\nsocket = "{setup.workdir / (name + ".sock")}"\n'
        f'[http]\nlisten = "127.0.0.1:0"\n')
    return skippyd_process(str(path), env={"XDG_RUNTIME_DIR": str(setup.workdir)}).start()


# -- a pass ------------------------------------------------------------------------------

@dataclass
class Pass:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    errors: int = 0
    detail: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def run_pass(url: str, requests: list[list[dict[str, str]]], streams: int,
                   max_tokens: int) -> Pass:
    """Send ``requests`` over ``streams`` closed-loop clients; output tok/s of the whole."""
    result = Pass()
    queue = list(reversed(requests))
    base = url if url.endswith("/v1") else url + "/v1"
    async with httpx.AsyncClient(timeout=600.0) as client:
        async def worker() -> None:
            while queue:
                messages = queue.pop()
                try:
                    response = await client.post(base + "/chat/completions", json={
                        "model": "any", "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, "stream": False})
                    response.raise_for_status()
                    body = response.json()
                except (httpx.HTTPError, ValueError) as exc:
                    result.errors += 1
                    result.detail = str(exc)[:200]
                    continue
                result.tokens += body["usage"]["completion_tokens"]
                details = body["usage"].get("completion_tokens_details") or {}
                timings = body.get("timings") or {}
                drafted = timings.get("draft_n")
                if drafted is None and "accepted_prediction_tokens" in details:
                    drafted = (details["accepted_prediction_tokens"]
                               + details.get("rejected_prediction_tokens", 0))
                result.drafted += int(drafted or 0)
                result.accepted += int(timings.get("draft_n_accepted",
                                                   details.get("accepted_prediction_tokens", 0)))

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(streams)))
        result.seconds = time.monotonic() - started
    return result


# -- rounds ------------------------------------------------------------------------------

@dataclass
class Cell:
    """One workload at one stream count: each side's per-round tok/s and counters."""

    tok_s: dict[str, list[float]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    detail: str = ""

    def ratio(self, side: str, anchor: str) -> tuple[float, float, float] | None:
        if side not in self.tok_s or anchor not in self.tok_s:
            return None
        ratios = [a / b for a, b in zip(self.tok_s[side], self.tok_s[anchor], strict=True) if b]
        return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None


def run(setup: Setup, sides: Sequence[str], workloads: Sequence[str], streams: Sequence[int],
        rounds: int, requests_per_stream: int) -> dict[tuple[str, int], Cell]:
    functions = standard_library_functions()
    cells = {(w, s): Cell() for w in workloads for s in streams}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        procs: dict[str, ServerProcess | SplitSide] = {}
        try:
            for side in order:
                procs[side] = start_side(setup, side)
            for (workload, n), cell in cells.items():
                runs: dict[str, list[Pass]] = {}
                for run_index, side in enumerate([*order, *order[::-1]]):
                    # Each pass of the round has prompts of its own, the same for every side.
                    first = (r * 2 + run_index // len(order)) * 1000 + n * 100
                    batch = prompts(workload, first, n * requests_per_stream, functions)
                    measured = asyncio.run(run_pass(procs[side].url, batch, n,
                                                    setup.max_tokens))
                    runs.setdefault(side, []).append(measured)
                    console.print(f"round {r + 1} {workload} x{n} {side}: "
                                  f"{measured.tok_s:.1f} tok/s, drafts "
                                  f"{measured.accepted}/{measured.drafted}, "
                                  f"errors {measured.errors}")
                for side, passes in runs.items():
                    cell.tok_s.setdefault(side, []).append(
                        statistics.mean(p.tok_s for p in passes))
                    cell.drafted[side] = cell.drafted.get(side, 0) + sum(p.drafted for p in passes)
                    cell.accepted[side] = (cell.accepted.get(side, 0)
                                           + sum(p.accepted for p in passes))
                    cell.errors += sum(p.errors for p in passes)
                    cell.detail = next((p.detail for p in passes if p.detail), cell.detail)
        finally:
            for proc in procs.values():
                proc.stop()
    return cells


#: ngram / off on the copy workload at 1 stream, where the gain is asked for.
COPY_GAIN = 1.3
#: ngram / off everywhere else: drafting may not cost more than this.
NO_LOSS = 0.98


def verdicts(cells: dict[tuple[str, int], Cell], *,
             gain_asked: bool = True) -> list[dict[str, Any]]:
    """``gain_asked``: the copy workload at 1 stream must gain :data:`COPY_GAIN` (the
    embedded model on one machine); otherwise every cell checks the cost side only."""
    rows = []
    for (workload, n), cell in cells.items():
        gain = gain_asked and (workload, n) == ("copy", 1)
        checks = [("skippyd off", COPY_GAIN if gain else NO_LOSS)]
        if (workload, n) == ("copy", 1):
            checks.append(("llama-server ngram-mod", 1.0))
        for anchor, target in checks:
            found = cell.ratio("skippyd ngram", anchor)
            if found is None:
                continue
            ratio, low, high = found
            rows.append({"workload": workload, "streams": n, "anchor": anchor,
                         "ngram_tok_s": statistics.median(cell.tok_s["skippyd ngram"]),
                         "anchor_tok_s": statistics.median(cell.tok_s[anchor]),
                         "ratio": ratio, "round_ratios": [low, high], "target": target,
                         "errors": cell.errors,
                         "met": ratio >= target and cell.errors == 0})
    return rows


def acceptance(cell: Cell, side: str) -> str:
    drafted = cell.drafted.get(side, 0)
    return f"{cell.accepted.get(side, 0)}/{drafted}" if drafted else "-"


def print_report(cells: dict[tuple[str, int], Cell], rows: list[dict[str, Any]]) -> None:
    table = Table(title="skippyd ngram against each anchor: medians over rounds")
    for column in ("workload", "streams", "anchor", "ngram tok/s", "anchor tok/s", "ratio",
                   "rounds' ratios", "target", "drafts accepted (ngram / anchor)", "verdict"):
        table.add_column(column)
    for row in rows:
        cell = cells[(row["workload"], row["streams"])]
        table.add_row(row["workload"], str(row["streams"]), row["anchor"],
                      f"{row['ngram_tok_s']:.1f}", f"{row['anchor_tok_s']:.1f}",
                      f"{row['ratio']:.3f}",
                      f"{row['round_ratios'][0]:.2f}-{row['round_ratios'][1]:.2f}",
                      f">= {row['target']}",
                      f"{acceptance(cell, 'skippyd ngram')} / {acceptance(cell, row['anchor'])}",
                      "MET" if row["met"] else "NOT MET")
    console.print(table)
    for (workload, n), cell in cells.items():
        if cell.errors:
            console.print(f"{workload} x{n}: {cell.errors} errors ({cell.detail})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser)
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama.cpp's llama-server (the ngram-mod anchor); optional")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stages", type=int, default=1,
                        help="serve the skippyd sides as a split pipeline of this many "
                             "stages (one pinned core each)")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="with --stages: every link's round trip, through the shaper")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.stages < 1 or (args.rtt_ms and args.stages == 1) or args.rtt_ms < 0:
        parser.error("--stages: at least 1; --rtt-ms: not negative, and only with --stages")
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")
    try:
        streams = [int(s) for s in args.streams.split(",") if s]
    except ValueError:
        parser.error("--streams: comma-separated integers")
    sides = [s for s in SIDES if (args.llama_server is not None and args.stages == 1)
             or not s.startswith("llama")]
    with tempfile.TemporaryDirectory(prefix="skippyd-spec-") as tmp:
        setup = Setup(model_path(args).resolve(), args.threads, args.lanes, args.ctx,
                      args.llama_server, Path(tmp), args.max_tokens, args.stages,
                      args.rtt_ms)
        cells = run(setup, sides, workloads, streams, args.rounds, args.requests_per_stream)
    rows = verdicts(cells, gain_asked=args.model is None and args.stages == 1)
    print_report(cells, rows)
    if args.json:
        args.json.write_text(json.dumps({
            "rows": rows,
            "cells": {f"{w}x{n}": {"tok_s": c.tok_s, "drafted": c.drafted,
                                   "accepted": c.accepted, "errors": c.errors}
                      for (w, n), c in cells.items()}}, indent=2))
    return 0 if rows and all(row["met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
