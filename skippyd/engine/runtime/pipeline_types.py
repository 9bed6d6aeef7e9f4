"""Plain records of a split pipeline, shared by stage 0 and later stages.

Stage 0's :class:`~skippyd.engine.runtime.pipeline.PipelineRuntime` produces entries,
the stage link (``skippyd.link.wire``) puts them on the wire, and a later
stage's link server turns them into direct iterations. The :class:`Downstream` protocol
is what the pipeline runtime needs from the link; the in-flight records are its
bookkeeping. They live in the engine so the engine never imports the server layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from skippyd.engine.runtime.contract import (
    IterationRequest,
    RuntimeFailure,
    SamplingConfig,
    UnavailableError,
)

logger = logging.getLogger(__name__)


class ChainUnavailableError(UnavailableError):
    """The downstream part of the pipeline is unreachable or was lost.

    The worker reports it as a retryable ``unavailable`` error (HTTP 503 with
    ``Retry-After``): what a client should see while stage 0 reconnects downstream.
    """


class ChainBatchError(RuntimeFailure):
    """A downstream stage could not run a batch (its runtime refused or failed it)."""


@dataclass(slots=True)
class ChainEntry:
    """One session's rows in a batch sent down the chain (one ITERATION frame)."""

    session_id: int
    """Stage 0's wire id of the session (unique per chain connection)."""
    first_position: int
    """Position of the first token; later stages trim a session that is ahead of it."""
    token_ids: Sequence[int]
    """The token sideband: the tokens these rows stand for (sampler history)."""
    rows: np.ndarray | None = None
    """float32 activation rows, shape ``(len(token_ids), n_embd)``, token-major."""
    sampling: SamplingConfig | None = None
    """Sampling parameters for the final stage (None: greedy)."""
    sample_last: bool = False
    """The final stage samples a token from the last row."""
    decode: bool = False
    """A decode step (phase hint only)."""
    has_positions: bool = True
    """Whether the position sideband is sent (always, by skippyd's own writers)."""
    draft_count: int = 0
    """The last this many tokens (and rows) are drafts the final stage verifies
    (speculative decoding); needs ``sample_last``."""
    lane: int | None = None
    """The sending stage's lane of the session: a later stage binds a new session to the
    same lane when it is idle there, so rows that share a batch on stage 0 lie in
    consecutive lanes on every stage (llama.cpp evaluates those together)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + len(self.token_ids))


@dataclass(frozen=True, slots=True)
class ChainSample:
    """The final stage's prediction for one entry of a batch."""

    index: int
    """Index of the entry within its batch."""
    token: int
    is_eog: bool
    followers: tuple[tuple[int, bool], ...] = ()
    """(token, ends generation) accepted after ``token`` at the entry's draft rows, in
    order; generation goes on from the last."""
    drafted: int = 0
    """Drafts the entry carried, accepted or not."""


class Downstream(Protocol):
    """Stage 0's link to the rest of the pipeline (``skippyd.link.dialer``)."""

    @property
    def epoch(self) -> int:
        """Number of the current connection; bumps on every reconnect."""
        ...

    @property
    def is_up(self) -> bool: ...

    @property
    def num_stages(self) -> int:
        """Stages behind stage 0 (learned at the handshake)."""
        ...

    def down_reason(self) -> str | None: ...

    def send_batch(self, request_id: int, entries: Sequence[ChainEntry]) -> None:
        """Send one batch; raises :class:`ChainUnavailableError` if the link is down."""
        ...

    def send_drop(self, session_id: int) -> None:
        """Tell the chain a session ended; raises :class:`ChainUnavailableError`."""
        ...

    def reset(self, epoch: int, reason: str) -> None:
        """Drop connection ``epoch`` (it stopped answering) and reconnect."""
        ...


@dataclass(slots=True, eq=False)
class InflightStep:
    """A sampled entry in flight: the final stage will predict its next token."""

    session_id: str
    start: int
    tokens: tuple[int, ...]
    sampling: SamplingConfig | None
    look_ahead: bool
    batch_id: int = 0
    result: ChainSample | None = None
    error: RuntimeFailure | None = None
    followed: bool = False
    """A look-ahead step was already started from this step's prediction (or none may
    be: a step with drafts)."""
    drafts: int = 0
    """Drafts shipped after ``tokens`` (their rows are in this stage's KV until the
    result says how many were accepted)."""

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def matches(self, request: IterationRequest, start: int) -> bool:
        return (request.sample_last and start == self.start
                and tuple(request.token_ids) == self.tokens and request.sampling == self.sampling)


@dataclass(slots=True)
class InflightBatch:
    epoch: int
    steps: list[InflightStep | None]
    """Per entry: its sampled step, or None for an entry that samples nothing."""
    sent_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class StageTimeline:
    """Where a stage's batches spend their time: cumulative seconds per phase.

    Divided by :attr:`batches` (a benchmark takes the difference of two readings) it is
    the per-batch timeline of a decode step: compute, the rest of the runtime call,
    serialise, send, and wait. Written by one thread per stage (stage 0's worker, a later
    stage's completer); readers see a slightly stale but consistent enough view.
    """

    batches: int = 0
    """Batches this stage finished (stage 0: sent)."""
    compute_s: float = 0.0
    """Inside ``llama_decode``."""
    runtime_s: float = 0.0
    """The rest of the runtime calls: filling the batch, copying rows out, sampling."""
    encode_s: float = 0.0
    """Building frames (serialising rows)."""
    send_s: float = 0.0
    """Writing frames to the socket."""
    wait_s: float = 0.0
    """Stage 0: waiting for predictions. Later stages: batches queued for the worker."""
    reply_s: float = 0.0
    """Later stages: from the worker's finish to the completer picking the batch up."""

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class PipelineCounters:
    """Cumulative counters for status and benchmarks."""

    local_compute_s: float = 0.0
    batches_sent: int = 0
    lookahead_steps: int = 0
    lookahead_hits: int = 0
    lookahead_retracted: int = 0
    started_at: float = field(default_factory=time.monotonic)
    timeline: StageTimeline = field(default_factory=StageTimeline)
    reply_last_s: float | None = None
    """Send-to-answer time of the last batch the final stage answered."""
    reply_avg_s: float | None = None
    """Moving average of that time: the whole chain's round trip, compute included."""

    def note_reply(self, seconds: float) -> None:
        self.reply_last_s = seconds
        self.reply_avg_s = seconds if self.reply_avg_s is None else (
            0.8 * self.reply_avg_s + 0.2 * seconds)


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens ``[begin, end)`` of request ``index`` of a call: one share of a group."""

    index: int
    begin: int
    end: int


#: A request is cut across groups only into pieces of at least this many tokens.
MIN_PIECE_TOKENS = 8


def split_token_groups(lengths: Sequence[int], groups: int) -> list[list[Piece]]:
    """Cut requests of ``lengths`` tokens, in order, into at most ``groups`` consecutive
    groups of nearly equal token counts.

    A request larger than what is left of a group's share is cut across groups (its
    first pieces sample nothing), so a prompt chunk travels down the pipeline in parts
    and the next stage starts on the first part while this one computes the second.
    Pieces are at least :data:`MIN_PIECE_TOKENS` long; a request too short to cut goes
    whole to the group holding most of it. Empty groups are left out.
    """
    total = sum(lengths)
    groups = max(1, min(groups, total))
    bounds = [round(total * g / groups) for g in range(1, groups + 1)]
    result: list[list[Piece]] = [[]]
    done = 0  # tokens placed so far
    for index, length in enumerate(lengths):
        begin = 0
        while begin < length:
            take = _share(length - begin, bounds[len(result) - 1] - done,
                          len(result) == groups, bool(result[-1]))
            if take == 0:
                result.append([])
                continue
            result[-1].append(Piece(index, begin, begin + take))
            begin += take
            done += take
    return [group for group in result if group]


#: A call's prompt tokens go in batches of at least this many (as evenly as they cut):
#: the smallest call that runs llama.cpp's tiled attention kernel (``docs/scheduler.md``),
#: above which a row costs no less, so a larger batch only lengthens the pipeline's fill.
PREFILL_PIECE_TOKENS = 64
#: Each batch cut off a call's last one keeps this share of its tokens for the end.
TAPER = 0.5


def split_call_groups(lengths: Sequence[int], groups: int, *,
                      taper: bool = False) -> list[list[Piece]]:
    """Batches of one pipeline call: :func:`split_token_groups`, but at least one group
    per :data:`PREFILL_PIECE_TOKENS` prompt tokens whatever ``groups`` says, and with
    ``taper`` the last batch cut in halves down to :data:`MIN_PIECE_TOKENS`.

    A call whose last piece is a prompt's sampled end (``taper``) waits until the last
    stage has run its last batch; stage 0 idles from its own end of that batch until then,
    so the last batch is kept small (the batches before it overlap stage 0's later work).
    Without prompt tokens the groups are :func:`split_token_groups`'s.
    """
    total = sum(lengths)
    if total <= len(lengths):
        return split_token_groups(lengths, groups)
    prompt = sum(n for n in lengths if n > 1)
    result = split_token_groups(lengths, max(groups, prompt // PREFILL_PIECE_TOKENS))
    while taper and result:
        tokens = sum(p.end - p.begin for p in result[-1])
        if tokens < 2 * MIN_PIECE_TOKENS:
            break
        cut = _cut_tail(result[-1], max(MIN_PIECE_TOKENS, round(tokens * TAPER)))
        if cut is None:
            break
        result[-1:] = cut
    return result


def _cut_tail(group: list[Piece], tail: int) -> list[list[Piece]] | None:
    """``group`` as two groups, the second holding about its last ``tail`` tokens; a
    piece is cut only if both parts keep :data:`MIN_PIECE_TOKENS`. None: no cut."""
    point = sum(p.end - p.begin for p in group) - tail
    done = 0
    for k, piece in enumerate(group):
        size = piece.end - piece.begin
        if done + size > point:
            offset = point - done
            if offset >= MIN_PIECE_TOKENS and size - offset >= MIN_PIECE_TOKENS:
                middle = piece.begin + offset
                return [[*group[:k], Piece(piece.index, piece.begin, middle)],
                        [Piece(piece.index, middle, piece.end), *group[k + 1:]]]
            at = k if offset < size - offset else k + 1  # the nearer piece boundary
            if 0 < at < len(group):
                return [group[:at], group[at:]]
            return None
        done += size
    return None


def _share(rest: int, room: int, last_group: bool, group_used: bool) -> int:
    """Tokens of a request's ``rest`` the current group takes; 0 closes the group."""
    if rest <= room or last_group:
        return rest
    if room >= MIN_PIECE_TOKENS and rest - room >= MIN_PIECE_TOKENS:
        return room
    if 2 * room >= rest or not group_used:
        return rest  # most of it fits (or the group is empty): take it whole
    return 0


#: Partitions of a call's decode rows whose cycle is within this share of the shortest
#: count as equal, and the one with most groups wins: a further group keeps a stage busy
#: while another batch travels, which the cycle below does not count.
GROUP_TIE = 0.03


def decode_group_sizes(rows: int, *, most: int, stages: int, step_ms: Sequence[float],
                       beside: Sequence[int] = ()) -> list[int]:
    """How many of ``rows`` decode rows go in each batch, smallest batch first.

    On a CPU a decode step's cost is not proportional to its rows: llama.cpp's
    quantised matrix kernels multiply four activation rows at a time and a shorter
    remainder row by row, so on the 1b shape one step of 4 rows costs about what 3 rows
    do. ``step_ms[k - 1]`` is what one step of ``k`` rows costs this stage (measured
    when it starts, :func:`time_decode_steps`); beyond the table a row costs what the
    largest step's rows do.

    A chain cycles through its batches: each stage must run all of them, and a batch's
    next step can start only once it has passed every stage, so a cycle takes at least
    ``max(sum of steps, stages * largest step)``, every stage's step taken to cost what
    this stage's does. ``beside`` are the rows of batches already in flight, which share
    the cycle. Of the partitions into at most ``most`` batches (equal ones, and runs of
    one size with a remainder), the one with the shortest cycle wins, more batches on a
    near tie (:data:`GROUP_TIE`).
    """
    if rows <= 0:
        return []
    table = [max(float(ms), 1e-6) for ms in step_ms] or [1.0]
    others = [n for n in beside if n > 0]

    def cost(n: int) -> float:
        return table[n - 1] if n <= len(table) else table[-1] * n / len(table)

    def cycle(sizes: list[int]) -> float:
        costs = [cost(n) for n in (*sizes, *others)]
        return max(sum(costs), max(1, stages) * max(costs))

    most = max(1, min(most, rows))
    candidates: set[tuple[int, ...]] = {tuple(sorted(_equal(rows, m)))
                                         for m in range(1, most + 1)}
    for size in range(-(-rows // most), rows + 1):  # sizes that make at most `most` runs
        runs = [size] * (rows // size) + ([rows % size] if rows % size else [])
        candidates.add(tuple(sorted(runs)))
    scored = sorted((cycle(list(sizes)), sizes) for sizes in candidates)
    best = scored[0][0]
    chosen = scored[0][1]
    for score, sizes in scored:
        if score <= best * (1 + GROUP_TIE) and len(sizes) > len(chosen):
            chosen = sizes
    return list(chosen)


#: A lane block size that leaves every stage two blocks wins over a larger one when its
#: cost per row is within this share of the larger one's (see :func:`lane_block_size`).
BLOCK_TIE = 0.08


def lane_block_size(lanes: int, *, stages: int, step_ms: Sequence[float]) -> int:
    """Lanes per decode block: the decode step with the least cost per row.

    Of the step sizes that tile the lanes (divide ``lanes``: no ragged last block) and
    leave every stage a block of its own (at most ``lanes // stages``), the one whose
    cost per row (``step_ms[k - 1] / k``) is least; the smallest of those within
    :data:`GROUP_TIE` of it, since one timing of each is noisy and a further block keeps
    a stage busy while another travels. When that leaves a stage fewer than two blocks,
    the largest size that leaves two is taken if its cost per row is within
    :data:`BLOCK_TIE`: the table is stage 0's alone, and the final stage also runs the
    output head, whose step grows faster with its rows (on the 1b shape, one core a
    stage: stage 0 took 61 ms for 4 rows and 125 for 8, the final stage 60 and 144), so
    with one block a stage the faster stage idles while the other runs the larger step.
    """
    most = min(len(step_ms), lanes // max(1, stages))
    sizes = [k for k in range(1, most + 1) if lanes % k == 0]
    if not sizes:
        return 1
    per_row = {k: max(float(step_ms[k - 1]), 1e-6) / k for k in sizes}
    best = min(per_row.values())
    chosen = next(k for k in sizes if per_row[k] <= best * (1 + GROUP_TIE))
    if lanes // chosen < 2 * stages:
        two_each = [k for k in sizes if k < chosen and lanes // k >= 2 * stages
                    and per_row[k] <= best * (1 + BLOCK_TIE)]
        if two_each:
            return max(two_each)
    return chosen


def _equal(rows: int, groups: int) -> list[int]:
    """``rows`` in ``groups`` parts that differ by at most one."""
    base, extra = divmod(rows, groups)
    return [base + 1] * extra + [base] * (groups - extra)
