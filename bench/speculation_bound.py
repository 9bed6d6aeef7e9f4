"""The most n-gram drafting could gain on the copy workload, here: an oracle's bound.

``bench/speculative.py`` measures what skippyd's drafting gains. This script says what
any draft-length policy could gain with the same drafter on the same machine, so a target
can be checked against physics before it is chased. In one process, on the bare llama.cpp
API (no server, no scheduler):

1. **Row costs.** ``c(r)``: the time of one ``llama_decode`` of ``r`` consecutive rows of
   one sequence, every row with logits (a decode row with ``r - 1`` drafts), at a
   position inside a copy answer; medians over interleaved repeats, so a drift of the
   host's speed touches every ``r`` alike.
2. **The answers.** The copy workload's prompts (``bench/speculative.py``: a standard
   library function and the instruction to rename one variable), prefilled and answered
   greedily one row at a time, timing the prefill.
3. **The oracle.** The request's own n-gram drafter (``skippyd.engine.policy.ngram``)
   replayed over each answer says, at every token, how many of its drafts the answer
   would accept. Knowing that in advance, dynamic programming picks the draft length of
   every step that finishes the answer soonest (``c(1 + k)`` per step, ``k`` from 0 to
   ``--max-draft``). No policy that has to guess can beat it.
4. **Fixed rules.** For comparison, a few rules without foresight on the same answers
   and costs (draft every proposal whole; only after an 8-token match; whole only after a
   step whose drafts were all kept): what a simple policy gets, between plain decoding
   and the oracle.
5. **skippyd's control** (``DraftControl``, what ``[speculative] mode = "ngram"``
   runs), replayed over the same answers with these row costs as its step costs: what
   serving would choose, without a server's noise.
6. **A fitted table.** A policy without foresight can see, when it picks a step's draft
   length, only what came before: the length of the run that matched, how many drafts
   were kept in a row up to this step, and how the last step went. A table that maps
   each such situation to a draft length, fitted on these very answers by coordinate
   descent (a local optimum that knows their statistics in aggregate, though not any one
   step's outcome), is an optimistic figure for a policy that sees no more.

It prints, per prompt and in total: plain decoding's time (``c(1)`` per token), the
oracle's, and the bound on the copy workload's output tok/s ratio (ngram / off) with the
prompt's prefill counted on both sides, as the workload's clients see it; also the bound
of a drafter whose every draft is right (``max (k + 1) c(1) / c(k + 1)``)::

    python bench/speculation_bound.py [--model PATH] [--threads 2] [--prompts 8]
        [--max-tokens 256] [--max-draft 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from llama_cpp import llama_cpp as L
from rich.console import Console
from rich.table import Table

from skippyd.bench.models import add_model_option, model_path
from skippyd.bench.runtime import decode_or_raise
from skippyd.daemon.assembly import chat_prompt_tokens
from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.draft_length import DraftControl
from skippyd.engine.policy.ngram import NgramIndex
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.tokenizer import Tokenizer
from skippyd.engine.worker.drafting import SpeculationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import copy_prompt, standard_library_functions  # noqa: E402

console = Console(width=None if Console().is_terminal else 140)
#: Repeats of every row count, interleaved (the median is taken).
COST_REPEATS = 7


@dataclass(frozen=True, slots=True)
class Answer:
    """One prompt's greedy answer and what its prefill took."""

    prompt_tokens: int
    tokens: tuple[int, ...]
    prefill_s: float


@dataclass(frozen=True, slots=True)
class Bound:
    """One answer's plain and oracle decode times, and the drafts the oracle used."""

    tokens: int
    prefill_s: float
    plain_s: float
    oracle_s: float
    steps: int
    drafted: int
    accepted: int

    @property
    def ratio(self) -> float:
        """Output tok/s with the oracle over plain decoding, prefill counted on both."""
        return (self.prefill_s + self.plain_s) / (self.prefill_s + self.oracle_s)


class Decoder:
    """One sequence on a bare llama.cpp context: prefill, greedy steps, timed calls."""

    def __init__(self, rt: LlamaRuntime, capacity: int) -> None:
        self.ctx = rt.context
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(capacity, 0, 1)
        self.greedy = L.llama_sampler_init_greedy()

    def close(self) -> None:
        L.llama_sampler_free(self.greedy)
        L.llama_batch_free(self.batch)

    def decode(self, tokens: Sequence[int], start: int, *, all_logits: bool) -> float:
        """Decode ``tokens`` at positions ``start..``; seconds the call took."""
        batch = self.batch
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i] = token, start + i
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        started = time.perf_counter()
        decode_or_raise(self.ctx, batch)
        return time.perf_counter() - started

    def sample(self, row: int) -> int:
        return int(L.llama_sampler_sample(self.greedy, self.ctx, row))

    def clear(self, start: int = 0) -> None:
        L.llama_memory_seq_rm(self.memory, 0, start, -1)

    def answer(self, prompt: Sequence[int], max_tokens: int, is_eog) -> Answer:
        self.clear()
        prefill_s = 0.0
        for start in range(0, len(prompt), 512):
            prefill_s += self.decode(prompt[start:start + 512], start, all_logits=False)
        tokens = [self.sample(min(512, len(prompt) - start) - 1)]
        while len(tokens) < max_tokens and not is_eog(tokens[-1]):
            self.decode(tokens[-1:], len(prompt) + len(tokens) - 1, all_logits=False)
            tokens.append(self.sample(0))
        return Answer(len(prompt), tuple(tokens), prefill_s)

    def row_costs(self, answer: Answer, prompt: Sequence[int], most_rows: int) -> list[float]:
        """``c(r)`` for ``r`` in ``1..most_rows`` (index ``r - 1``), seconds."""
        history = [*prompt, *answer.tokens]
        keep = len(prompt) + min(len(answer.tokens) // 2, 64)
        self.clear()
        for start in range(0, keep, 512):
            self.decode(history[start:min(keep, start + 512)], start, all_logits=False)
        rows = (list(history[keep:]) + [history[-1]] * most_rows)[:most_rows]
        samples: list[list[float]] = [[] for _ in range(most_rows)]
        for _ in range(COST_REPEATS):
            for r in range(1, most_rows + 1):
                samples[r - 1].append(self.decode(rows[:r], keep, all_logits=True))
                self.clear(keep)
        return [statistics.median(s) for s in samples]


@dataclass(frozen=True, slots=True)
class Proposal:
    """What the drafter proposes at one token of an answer, and what the answer keeps."""

    drafts: int
    """Tokens proposed (at most the limit)."""
    match: int
    """Length of the run of last tokens found again (0: nothing proposed)."""
    accepted: int
    """Leading drafts the answer confirms."""


def proposals(prompt: Sequence[int], answer: Sequence[int], most: int) -> list[Proposal]:
    """Per ``j`` (answer tokens known, the last one pending), the drafter's proposal of
    up to ``most`` tokens and how many of them the answer accepts; index ``j - 1``."""
    index = NgramIndex()
    index.extend(prompt)
    index.extend(answer[:1])
    out = []
    for j in range(1, len(answer)):
        drafts, match = index.propose(most)
        hits = 0
        for draft, actual in zip(drafts, answer[j:], strict=False):
            if draft != actual:
                break
            hits += 1
        out.append(Proposal(len(drafts), match, hits))
        index.extend(answer[j:j + 1])
    return out


def accepted_drafts(prompt: Sequence[int], answer: Sequence[int], most: int) -> list[int]:
    """Per ``j``, how many of the drafter's up to ``most`` drafts the answer accepts."""
    return [p.accepted for p in proposals(prompt, answer, most)]


#: The steps an answer took so far, each as (drafts carried, drafts kept).
History = Sequence[tuple[int, int]]
#: A policy without foresight: (this step's proposal, the steps so far) -> drafts to carry.
Rule = Callable[[Proposal, History], int]


def _kept_all(history: History) -> bool:
    return not history or history[-1][0] == history[-1][1]


#: Fixed rules a policy without foresight could follow, for comparison with the oracle.
RULES: dict[str, Rule] = {
    "every proposal, whole": lambda p, history: p.drafts,
    "8-token matches only": lambda p, history: p.drafts if p.match >= 8 else 0,
    "after a fully kept step": lambda p, history: (p.drafts if _kept_all(history)
                                                   else min(p.drafts, 2)),
}


def follow(rule: Rule, found: Sequence[Proposal],
           costs: Sequence[float]) -> tuple[float, int, int, int]:
    """Decode an answer with ``rule`` choosing each step's drafts (no foresight):
    (seconds, steps, drafted, accepted)."""
    n = len(found) + 1
    j, seconds, drafted, accepted = 1, 0.0, 0, 0
    history: list[tuple[int, int]] = []
    while j < n:
        proposal = found[j - 1]
        k = max(0, min(rule(proposal, history), proposal.drafts, len(costs) - 1))
        hits = min(k, proposal.accepted)
        seconds += costs[k]
        drafted, accepted = drafted + k, accepted + hits
        history.append((k, hits))
        j += hits + 1
    return seconds, len(history), drafted, accepted


#: Draft lengths the fitted table chooses from.
TABLE_LENGTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
#: Passes of coordinate descent over the table's entries.
TABLE_PASSES = 3
#: The fitted table's name among the rules reported.
TABLE_RULE = "a table of what a policy sees, fitted on these answers"
#: skippyd's control's name among the rules reported.
CONTROL_RULE = "skippyd's control (DraftControl)"


class ControlRule:
    """skippyd's draft-length control replayed over answers, one after another as one
    stream's requests: the row costs measured here are its decode steps' costs, each
    answer starts a request's record, and what drafts of each kind get carries over."""

    def __init__(self, costs: Sequence[float], min_draft: int, max_draft: int) -> None:
        self.control = DraftControl(min_draft, max_draft)
        self.min_draft = min_draft
        for rows, seconds in enumerate(costs, start=1):
            work = [IterationWork(f"row{i}", (1,), (i,), True, IterationPhase.DECODE)
                    for i in range(rows)]
            self.control.observe(IterationPlan(work=work, token_count=rows), seconds)
        self.stats = self.control.new_stats()
        self._kind = 0

    def __call__(self, proposal: Proposal, history: History) -> int:
        if not history:
            self.stats = self.control.new_stats()  # a new request
        else:
            carried, kept = history[-1]
            if carried:
                self.control.record(self.stats, self._kind, carried, kept)
            else:
                self.control.note_plain_step(self.stats, 1)
        self._kind = proposal.match
        if proposal.drafts < self.min_draft:
            return 0
        return self.control.draft_length(self.control.chances(self.stats, proposal.match),
                                         1, 1, proposal.drafts, stats=self.stats)


#: Where the bins of drafts kept in a row start (:func:`situation`).
IN_A_ROW_BINS = (1, 8, 24)


def situation(proposal: Proposal, history: History) -> tuple[int, int, int]:
    """What a policy can see when it picks a draft length: the matched run's length,
    the drafts kept in a row up to now (0, 1-7, 8-23, 24 or more: a bin), and the last
    step (0: none yet, 1: it carried no drafts, 2: it kept them all, 3: it lost some)."""
    in_a_row = 0
    for carried, kept in reversed(history):
        if carried == 0 or in_a_row >= IN_A_ROW_BINS[-1]:
            break
        in_a_row += kept
        if kept < carried:
            break
    bin_ = sum(1 for start in IN_A_ROW_BINS if in_a_row >= start)
    if not history:
        last = 0
    else:
        carried, kept = history[-1]
        last = 1 if carried == 0 else 2 if kept == carried else 3
    return proposal.match, bin_, last


def fit_table(answers: Sequence[Sequence[Proposal]], costs: Sequence[float],
              most: int) -> tuple[dict[tuple[int, int, int], int], float]:
    """A table of draft lengths by :func:`situation` that decodes ``answers`` in less
    total time than any table one entry away (coordinate descent from "draft nothing",
    a local optimum): (table, seconds)."""
    table: dict[tuple[int, int, int], int] = {}

    def rule(proposal: Proposal, history: History) -> int:
        return table.get(situation(proposal, history), 0)

    def total() -> float:
        return sum(follow(rule, found, costs)[0] for found in answers)

    matches = sorted({p.match for found in answers for p in found if p.drafts})
    # Drafts kept in a row come only after a step that carried drafts: (last 0 or 1)
    # means none, and a step that kept all its drafts (last 2) means some.
    situations = [(0, 0), (0, 1), *((bin_, 2) for bin_ in range(1, len(IN_A_ROW_BINS) + 1)),
                  *((bin_, 3) for bin_ in range(len(IN_A_ROW_BINS) + 1))]
    keys = [(match, bin_, last) for match in matches for bin_, last in situations]
    lengths = [k for k in TABLE_LENGTHS if k <= most]
    best = total()
    for _ in range(TABLE_PASSES):
        improved = False
        for key in keys:
            was = table.get(key, 0)
            for k in lengths:
                if k == was:
                    continue
                table[key] = k
                seconds = total()
                if seconds < best - 1e-12:
                    best, was, improved = seconds, k, True
            table[key] = was
        if not improved:
            break
    return {key: k for key, k in table.items() if k}, best


def oracle(accepted: Sequence[int], costs: Sequence[float], most: int) -> tuple[float, int, int, int]:
    """The fastest schedule of draft lengths: (seconds, steps, drafted, accepted).

    State ``j`` (1-based, answer tokens emitted) runs one step of ``1 + k`` rows and
    moves to ``j + min(k, accepted[j - 1]) + 1``; the answer is done at ``len + 1``.
    """
    n = len(accepted) + 1
    best: list[tuple[float, int, int, int]] = [(0.0, 0, 0, 0)] * (n + 1)
    for j in range(n - 1, 0, -1):
        options = []
        for k in range(0, most + 1):
            hits = min(k, accepted[j - 1])
            then = best[min(n, j + hits + 1)]
            options.append((costs[k] + then[0], then[1] + 1, then[2] + k, then[3] + hits))
        best[j] = min(options)
    return best[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="copy prompts (default 8)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-draft", type=int, default=16,
                        help="most drafts a step may carry (default 16, the config's)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    for name in ("threads", "prompts", "max_tokens", "max_draft"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path = model_path(args)
    tokenizer = Tokenizer(path)
    functions = standard_library_functions()[:args.prompts]
    prompts = [chat_prompt_tokens(tokenizer, copy_prompt(f)) for f in functions]
    ctx = max(len(p) for p in prompts) + args.max_tokens + args.max_draft + 8
    options = RuntimeOptions(str(path), lane_count=1, ctx_size=ctx, n_batch=512,
                             n_ubatch=512, threads=args.threads)
    with LlamaRuntime(options) as rt:
        decoder = Decoder(rt, 512)
        try:
            answers = [decoder.answer(p, args.max_tokens, tokenizer.is_eog) for p in prompts]
            longest = max(range(len(answers)), key=lambda i: len(answers[i].tokens))
            costs = decoder.row_costs(answers[longest], prompts[longest], args.max_draft + 1)
        finally:
            decoder.close()
    tokenizer.close()
    bounds = []
    ruled: dict[str, list[float]] = {name: [0.0, 0.0, 0.0]
                                     for name in [*RULES, CONTROL_RULE, TABLE_RULE]}
    replayed = [proposals(prompt, answer.tokens, args.max_draft)
                for prompt, answer in zip(prompts, answers, strict=True)]
    table, _ = fit_table(replayed, costs, args.max_draft)
    rules_here: dict[str, Rule] = {
        **RULES, CONTROL_RULE: ControlRule(costs, SpeculationSettings().min_draft, args.max_draft),
        TABLE_RULE: lambda p, history: table.get(situation(p, history), 0)}
    for answer, found in zip(answers, replayed, strict=True):
        seconds, steps, drafted, hits = oracle([p.accepted for p in found], costs,
                                               args.max_draft)
        bounds.append(Bound(len(answer.tokens), answer.prefill_s,
                            (len(answer.tokens) - 1) * costs[0], seconds, steps, drafted, hits))
        for name, rule in rules_here.items():
            taken, _, rule_drafted, rule_hits = follow(rule, found, costs)
            ruled[name][0] += taken
            ruled[name][1] += rule_drafted
            ruled[name][2] += rule_hits
    perfect = max((k + 1) * costs[0] / costs[k] for k in range(len(costs)))
    total = Bound(*(sum(getattr(b, f) for b in bounds) for f in (
        "tokens", "prefill_s", "plain_s", "oracle_s", "steps", "drafted", "accepted")))
    rules = {name: Bound(total.tokens, total.prefill_s, total.plain_s, taken, 0,
                         int(drafted), int(hits))
             for name, (taken, drafted, hits) in ruled.items()}
    report(costs, bounds, total, perfect, rules)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": str(path), "threads": args.threads, "row_cost_ms": [c * 1000 for c in costs],
            "answers": [{**asdict(b), "ratio": b.ratio} for b in bounds],
            "total": {**asdict(total), "ratio": total.ratio},
            "decode_only_ratio": total.plain_s / total.oracle_s,
            "rules": {name: {**asdict(b), "ratio": b.ratio} for name, b in rules.items()},
            "table": {"/".join(map(str, key)): k for key, k in sorted(table.items())},
            "perfect_drafter_ratio": perfect}, indent=2))
    return 0


def report(costs: Sequence[float], bounds: Sequence[Bound], total: Bound,
           perfect: float, rules: dict[str, Bound]) -> None:
    rows = Table(title="one llama_decode of r rows of one sequence, logits on every row")
    rows.add_column("rows", justify="right")
    rows.add_column("ms", justify="right")
    rows.add_column("ms per row", justify="right")
    rows.add_column("vs r x c(1)", justify="right")
    for r, cost in enumerate(costs, start=1):
        rows.add_row(str(r), f"{cost * 1000:.2f}", f"{cost * 1000 / r:.2f}",
                     f"{cost / (r * costs[0]):.2f}")
    console.print(rows)
    table = Table(title="copy workload: plain decoding against the oracle's draft lengths")
    for column in ("answer", "tokens", "prefill s", "plain decode s", "oracle decode s",
                   "steps", "drafts accepted", "bound (tok/s ratio)"):
        table.add_column(column, justify="right")
    for i, b in enumerate([*bounds, total]):
        table.add_row("all" if b is total else str(i + 1), str(b.tokens), f"{b.prefill_s:.2f}",
                      f"{b.plain_s:.2f}", f"{b.oracle_s:.2f}", str(b.steps),
                      f"{b.accepted}/{b.drafted}", f"{b.ratio:.3f}")
    console.print(table)
    console.print(f"decode alone (no prefill): {total.plain_s / total.oracle_s:.3f}x; "
                  f"a drafter that is always right: {perfect:.3f}x")
    table = Table(title="policies without foresight, the same answers and costs (the fitted "
                        "table knows these answers in aggregate: an optimistic figure)")
    for column in ("rule", "decode s", "drafts accepted", "tok/s ratio"):
        table.add_column(column, justify="right")
    for name, b in rules.items():
        table.add_row(name, f"{b.oracle_s:.2f}", f"{b.accepted}/{b.drafted}", f"{b.ratio:.3f}")
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
