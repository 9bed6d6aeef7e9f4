"""Stage 0 of a split pipeline as one :class:`~skippyd.engine.runtime.contract.Runtime`.

:class:`PipelineRuntime` wraps stage 0's own layer slice and the link to the rest of
the chain, so stage 0's unchanged worker and policy drive the whole pipeline: each
``run_iteration`` runs the local layers, ships the rows downstream as batches and returns
the predictions the final stage sends straight back. It keeps the chain busy with
prefill chunks that flow without waiting, decode groups (one per stage by default) and
decode look-ahead; ``docs/stage-protocol.md`` explains all three. Only the worker thread
calls this object, except the ``on_*`` listener callbacks (the link's reader thread).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from skippyd.engine.runtime.contract import (
    ComputeHook,
    InvalidIterationError,
    IterationOutput,
    IterationRequest,
    IterationSample,
    RowPhase,
    Runtime,
    RuntimeFailure,
    SavedState,
    SessionAlignment,
)
from skippyd.engine.runtime.pipeline_types import (
    PREFILL_PIECE_TOKENS,
    ChainBatchError,
    ChainEntry,
    ChainSample,
    ChainUnavailableError,
    Downstream,
    InflightBatch,
    InflightStep,
    Piece,
    PipelineCounters,
    decode_group_sizes,
    lane_block_size,
    split_call_groups,
    split_token_groups,
)
from skippyd.engine.runtime.watch import CallWatch, unwatched

logger = logging.getLogger(__name__)

#: Batches sent but not yet answered by the final stage (the credit window).
MAX_INFLIGHT_BATCHES = 8
#: A sampled batch with no reply for this long means the chain is stuck.
REPLY_TIMEOUT_S = 30.0
_NO_LANE_KV = "a split pipeline keeps no lane KV for a prefix cache"


class PipelineRuntime:
    """Stage 0's slice plus the downstream chain, behind the Runtime protocol.

    Args:
        local: Stage 0's own runtime (first stage, not final).
        downstream: The link to stage 1; its reader thread calls ``on_result``,
            ``on_error`` and ``on_down`` of this object.
        decode_groups: Groups per call (``runtime.pipeline_decode_groups``); None means
            one per pipeline stage plus one, as the handshake reports the chain's length.
        step_ms: What a decode step of 1, 2, … rows costs the local slice
            (``step_probe.time_decode_steps``). With it, decode rows go one batch per
            lane block (:attr:`block_lanes`), or, for sessions without a lane yet, in
            batches of the sizes that cycle the chain fastest (``decode_group_sizes``),
            at most ``decode_groups`` of them; without it, in equal batches.
    """

    def __init__(self, local: Runtime, downstream: Downstream, *,
                 decode_groups: int | None = None,
                 step_ms: Sequence[float] | None = None,
                 reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.local = local
        self.counters = PipelineCounters()
        self._link = downstream
        self._decode_groups = decode_groups
        self.step_ms: tuple[float, ...] = tuple(step_ms or ())
        self._reply_timeout_s = reply_timeout_s
        self._cond = threading.Condition()
        self._steps: dict[str, InflightStep] = {}
        self._batches: dict[int, InflightBatch] = {}
        self._async_error: str | None = None
        self._wire_ids: dict[str, int] = {}
        self._shipped_epoch: dict[str, int] = {}
        self._drafting: set[str] = set()
        """Sessions whose last step carried drafts: no look-ahead for them (the next
        step will likely carry drafts again, which a look-ahead step cannot)."""
        self._next_wire_id = 1
        self._next_batch_id = 1
        self.watch: CallWatch = unwatched()

    # -- facts (Runtime protocol) ------------------------------------------------------

    @property
    def lane_count(self) -> int:
        return self.local.lane_count

    @property
    def kv_pool_tokens(self) -> int:
        return self.local.kv_pool_tokens

    @property
    def max_batch_tokens(self) -> int:
        return self.local.max_batch_tokens

    @property
    def micro_batch_tokens(self) -> int:
        return self.local.micro_batch_tokens

    @property
    def max_session_tokens(self) -> int:
        return self.local.max_session_tokens

    def active_session_count(self) -> int:
        return self.local.active_session_count()

    def ensure_session_active(self, session_id: str, lane: int | None = None,
                              keep_tokens: int = 0) -> None:
        # Later stages bind the session to the same lane at its first iteration when it
        # is idle there (ChainEntry.lane). A split keeps no prefix cache, so what an idle
        # lane still holds is worth nothing: a new session takes the lowest idle lane,
        # and decoding sessions fill whole lane blocks (block_lanes).
        if lane is None and self.local.lane_of(session_id) is None:
            lane = next(iter(self.local.idle_lanes()), None)
        self.local.ensure_session_active(session_id, lane, keep_tokens)

    def kv_cells_used(self) -> int:
        """Stage 0's own KV cells (every later stage holds the same sessions)."""
        return self.local.kv_cells_used()

    def session_token_count(self, session_id: str) -> int | None:
        """Tokens of the session as the scheduler sees them (look-ahead excluded)."""
        count = self.local.session_token_count(session_id)
        step = self._steps.get(session_id)
        if count is not None and step is not None and step.look_ahead:
            return step.start
        return count

    def close(self) -> None:
        """Free the local runtime (the link is closed by its owner)."""
        self.local.close()

    def set_compute_hook(self, hook: ComputeHook | None) -> bool:
        """False: a call's computations are spread over the chain, and the caller runs
        the hook before each call."""
        return False

    # -- what a pipeline does not do ---------------------------------------------------
    # Choices share a prompt by forking a session on every stage, and the prefix cache
    # reuses a lane's KV on every stage: neither crosses the link yet.

    @property
    def can_fork(self) -> bool:
        return False

    def fork_session(self, src_session_id: str, dst_session_id: str,
                     num_tokens: int | None = None) -> None:
        raise InvalidIterationError("a split pipeline cannot fork sessions")

    @property
    def keeps_lane_kv(self) -> bool:
        return False

    @property
    def shares_kv_pool(self) -> bool:
        return self.local.shares_kv_pool

    def clear_lane(self, lane: int) -> None:
        self.local.clear_lane(lane)

    def session_history(self, session_id: str) -> tuple[int, ...]:
        return self.local.session_history(session_id)

    def lane_history(self, lane: int) -> tuple[int, ...]:
        return self.local.lane_history(lane)

    def lane_of(self, session_id: str) -> int | None:
        return self.local.lane_of(session_id)

    def idle_lanes(self) -> list[int]:
        return self.local.idle_lanes()

    def copy_lane_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        raise InvalidIterationError(_NO_LANE_KV)

    def save_lane_state(self, lane: int, size: int | None = None) -> SavedState:
        raise InvalidIterationError(_NO_LANE_KV)

    def lane_state_bytes(self, lane: int) -> int:
        raise InvalidIterationError(_NO_LANE_KV)

    def load_session_state(self, session_id: str, state: Any,
                           tokens: Sequence[int]) -> bool:
        raise InvalidIterationError(_NO_LANE_KV)

    # -- sessions ----------------------------------------------------------------------

    def drop_session(self, session_id: str) -> None:
        """Free the session here and, through a DROP frame, on every later stage."""
        self.local.drop_session(session_id)
        self._drafting.discard(session_id)
        with self._cond:
            self._steps.pop(session_id, None)
        wire_id = self._wire_ids.pop(session_id, None)
        epoch = self._shipped_epoch.pop(session_id, None)
        if wire_id is None or epoch != self._link.epoch or not self._link.is_up:
            return  # never shipped on the current connection: nothing to free downstream
        try:
            self._link.send_drop(wire_id)
        except ChainUnavailableError:
            pass  # the chain is gone and with it the session

    def trim_session(self, session_id: str, token_count: int) -> None:
        """Trim here; later stages trim when the session's next frame starts earlier."""
        self._retract(session_id)
        self.local.trim_session(session_id, token_count)

    def align_session_to_token_count_if_ahead(
        self, session_id: str, target: int
    ) -> SessionAlignment | None:
        self._retract(session_id)
        return self.local.align_session_to_token_count_if_ahead(session_id, target)

    def _retract(self, session_id: str) -> None:
        """Forget a look-ahead step and remove its token from the local KV."""
        with self._cond:
            step = self._steps.pop(session_id, None)
        if step is not None and step.look_ahead:
            self.counters.lookahead_retracted += 1
            if self.local.session_token_count(session_id) is not None:
                self.local.trim_session(session_id, step.start)

    # -- iterations ---------------------------------------------------------------------

    def run_iteration(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        """Run the local layers, ship the rows, and return the final stage's samples.

        Raises:
            ChainUnavailableError: The downstream chain is down or was lost.
            ChainBatchError: A downstream stage failed a batch.
            RuntimeFailure: The local runtime refused or failed (nothing was shipped
                for the failing group).
        """
        if not requests:
            return IterationOutput()
        with self.watch:
            return self._iterate(requests)

    def _iterate(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        self._check_chain(requests)
        starts = [self._start_of(r) for r in requests]
        needed, fresh = self._match(requests, starts)
        lookahead_batches = {step.batch_id for step in needed.values()}
        compute_s = 0.0
        # Without step costs, look-ahead steps of this call's sequences are shipped in
        # groups of this size (with them, in lane blocks).
        group_rows = -(-len(requests) // self._num_groups())
        # Look-ahead batches already form groups of their own.
        groups = max(1, self._num_groups() - len(lookahead_batches))
        # A request with drafts travels whole: its rows count as one decode row here.
        lengths = [1 if requests[i].draft else len(requests[i].token_ids) for i in fresh]
        # A call whose last piece ends a sampled prompt waits for that batch on every stage.
        taper = bool(fresh) and requests[fresh[-1]].sample_last and lengths[-1] > 1
        # Prompt chunks at the end of the call that sample nothing are waited for by no
        # one: they go last, in batches of about PREFILL_PIECE_TOKENS, and the call
        # returns while the later stages compute them.
        head = len(lengths)
        while (head > 0 and lengths[head - 1] > 1
               and not requests[fresh[head - 1]].sample_last):
            head -= 1
        decode_only = head > 0 and max(lengths[:head]) == 1
        if decode_only:
            # llama.cpp evaluates rows of consecutive lanes together and splits a batch
            # at every gap between lanes: decode rows are cut into groups in lane order.
            fresh[:head] = sorted(fresh[:head], key=lambda i: self._lane_rank(requests[i]))
        size = self.block_lanes
        blocks = (self._blocks([requests[i].session_id for i in fresh[:head]], size)
                  if decode_only and size else None)
        if head == 0:
            call_groups = split_call_groups(lengths, groups)
        elif blocks is not None:
            call_groups = _runs([len(list(run)) for _, run in itertools.groupby(blocks)])
        elif self.step_ms and decode_only:
            beside = [sum(1 for s in needed.values() if s.batch_id == batch)
                      for batch in lookahead_batches]
            call_groups = _runs(decode_group_sizes(head, most=groups, stages=self._stages(),
                                                   step_ms=self.step_ms, beside=beside))
        else:
            call_groups = split_call_groups(lengths[:head], groups,
                                            taper=taper and head == len(lengths))
        if 0 < head < len(lengths):
            rest = lengths[head:]
            pieces = split_token_groups(rest, max(1, sum(rest) // PREFILL_PIECE_TOKENS))
            call_groups += [[Piece(head + p.index, p.begin, p.end) for p in group]
                            for group in pieces]
        for group in call_groups:
            items = [_piece(requests[fresh[p.index]], starts[fresh[p.index]], p) for p in group]
            steps, seconds = self._ship(items, look_ahead=False)
            compute_s += seconds
            needed.update({fresh[p.index]: s for p, s in zip(group, steps, strict=True)
                           if s is not None})
        compute_s += self._await(list(needed.values()), group_rows)
        return self._output(requests, needed, compute_s)

    def _lane_rank(self, request: IterationRequest) -> int:
        lane = self.local.lane_of(request.session_id)
        return self.local.lane_count if lane is None else lane

    @property
    def block_lanes(self) -> int:
        """Lanes per decode block (0: no blocks, without measured step costs).

        With step costs, decode rows travel in *lane blocks*: lanes ``[k*n, (k+1)*n)``,
        ``n`` the step size with the least cost per row (``lane_block_size``). llama.cpp
        evaluates a batch's rows of consecutive lanes together and runs every other
        stretch apart (a weight pass each), and a decode batch keeps its rows from one
        step to the next (look-ahead): a batch cut from whichever rows were ready at the
        time would stay scattered over the lanes for the rest of its streams' answers.
        """
        if not self.step_ms:
            return 0
        return lane_block_size(self.local.lane_count, stages=self._stages(),
                               step_ms=self.step_ms)

    def _blocks(self, session_ids: Sequence[str], size: int) -> list[int] | None:
        """The lane block of each session, blocks of ``size`` lanes (None when a session
        has no lane yet)."""
        blocks = []
        for session_id in session_ids:
            lane = self.local.lane_of(session_id)
            if lane is None:
                return None
            blocks.append(lane // size)
        return blocks

    def _check_chain(self, requests: Sequence[IterationRequest]) -> None:
        if not self._link.is_up:
            reason = self._link.down_reason() or "not connected"
            raise ChainUnavailableError(f"the downstream pipeline is unavailable: {reason}")
        with self._cond:
            error, self._async_error = self._async_error, None
        if error is not None:
            raise ChainBatchError(f"a downstream stage failed a batch: {error}")
        epoch = self._link.epoch
        for request in requests:
            shipped = self._shipped_epoch.get(request.session_id)
            if shipped is not None and shipped != epoch:
                raise ChainUnavailableError(
                    f"session {request.session_id} lived on a pipeline connection that was lost")

    def _start_of(self, request: IterationRequest) -> int:
        if request.positions:
            return int(request.positions[0])
        return self.session_token_count(request.session_id) or 0

    def _match(self, requests: Sequence[IterationRequest],
               starts: list[int]) -> tuple[dict[int, InflightStep], list[int]]:
        """Requests already in flight as look-ahead steps, and the rest."""
        needed: dict[int, InflightStep] = {}
        fresh: list[int] = []
        for index, (request, start) in enumerate(zip(requests, starts, strict=True)):
            if request.draft:
                self._drafting.add(request.session_id)
            else:
                self._drafting.discard(request.session_id)
            step = self._steps.get(request.session_id)
            if step is not None and step.matches(request, start) and not request.draft:
                needed[index] = step
                self.counters.lookahead_hits += 1
                continue
            if step is not None:
                self._retract(request.session_id)
            fresh.append(index)
        return needed, fresh

    def _stages(self) -> int:
        return self._link.num_stages + 1

    def _num_groups(self) -> int:
        if self._decode_groups is not None:
            return max(1, self._decode_groups)
        # One group per stage keeps every stage busy only if nothing else takes time;
        # one more is always travelling (a link, a scheduler turn) and fills that gap.
        return self._link.num_stages + 2

    def _ship(self, items: list[tuple[IterationRequest, int]],
              look_ahead: bool) -> tuple[list[InflightStep | None], float]:
        """Compute ``items`` locally and send them downstream as one batch.

        A request's drafts are plain rows here, after its input; the final stage
        verifies them, and :meth:`_output` removes the rejected ones from this stage.
        """
        local = [IterationRequest(r.session_id, (*r.token_ids, *r.draft),
                                  positions=range(start, start + r.num_rows),
                                  sampling=r.sampling, phase=r.phase, lane=r.lane)
                 for r, start in items]
        started = time.perf_counter()
        output = self.local.run_iteration(local)
        timeline = self.counters.timeline
        timeline.runtime_s += time.perf_counter() - started - output.compute_s
        timeline.compute_s += output.compute_s
        self.counters.local_compute_s += output.compute_s
        entries, steps = [], []
        for (request, start), rows in zip(items, output.output_rows, strict=True):
            entries.append(ChainEntry(
                session_id=self._wire_id(request.session_id), first_position=start,
                token_ids=[*request.token_ids, *request.draft], rows=rows,
                sampling=request.sampling if request.sample_last else None,
                sample_last=request.sample_last, decode=request.phase is RowPhase.DECODE,
                draft_count=len(request.draft), lane=self.local.lane_of(request.session_id),
            ))
            steps.append(InflightStep(request.session_id, start, tuple(request.token_ids),
                                      request.sampling, look_ahead,
                                      drafts=len(request.draft),
                                      followed=bool(request.draft))
                         if request.sample_last else None)
        self._send(entries, steps, [r.session_id for r, _ in items])
        return steps, output.compute_s

    def _wire_id(self, session_id: str) -> int:
        wire_id = self._wire_ids.get(session_id)
        if wire_id is None:
            wire_id = self._wire_ids[session_id] = self._next_wire_id
            self._next_wire_id += 1
        return wire_id

    def _send(self, entries: list[ChainEntry], steps: list[InflightStep | None],
              session_ids: list[str]) -> None:
        epoch = self._link.epoch
        with self._cond:
            self._wait_for_credit()
            batch_id = self._next_batch_id
            self._next_batch_id += 1
            self._batches[batch_id] = InflightBatch(epoch, steps)
            for step in steps:
                if step is None:
                    continue
                step.batch_id = batch_id
                if step.look_ahead:
                    self._steps[step.session_id] = step
        try:
            self._link.send_batch(batch_id, entries)
        except ChainUnavailableError:
            with self._cond:
                self._batches.pop(batch_id, None)
            raise
        self.counters.batches_sent += 1
        self.counters.timeline.batches += 1
        for session_id in session_ids:
            # The first connection a session was shipped on is the one holding its KV.
            self._shipped_epoch.setdefault(session_id, epoch)

    def _wait_for_credit(self) -> None:
        """Caller holds the condition. Bounds the batches the chain must buffer."""
        epoch = self._link.epoch
        deadline = time.monotonic() + self._reply_timeout_s
        while len(self._batches) >= MAX_INFLIGHT_BATCHES:
            if not self._link.is_up or self._link.epoch != epoch:
                raise ChainUnavailableError("the downstream pipeline was lost")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._link.reset(epoch, f"no reply for {self._reply_timeout_s:.0f} s")
                raise ChainUnavailableError("the downstream pipeline stopped answering")
            self._cond.wait(remaining)

    def _await(self, steps: list[InflightStep], group_rows: int) -> float:
        """Wait for every step's prediction, starting look-ahead steps (in groups of
        ``group_rows``) meanwhile."""
        compute_s = 0.0
        held: list[tuple[IterationRequest, int]] = []
        deadline = time.monotonic() + self._reply_timeout_s
        while True:
            with self._cond:
                arrived = self._poll(steps, deadline)
                if arrived is None:
                    return compute_s
            compute_s += self._start_lookahead(arrived, group_rows, held, steps)
            deadline = time.monotonic() + self._reply_timeout_s

    def _poll(self, steps: list[InflightStep], deadline: float) -> list[InflightStep] | None:
        """Caller holds the condition. None when all answered; else steps to follow."""
        epoch = self._link.epoch
        while True:
            failed = next((s.error for s in steps if s.error is not None), None)
            if failed is not None:
                raise failed
            pending = [s for s in steps if s.result is None]
            if not pending:
                return None
            arrived = [s for s in steps if s.result is not None and not s.followed
                       and not s.result.is_eog]
            if arrived:
                return arrived
            if not self._link.is_up or self._link.epoch != epoch:
                raise ChainUnavailableError(
                    f"the downstream pipeline was lost: {self._link.down_reason()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._link.reset(epoch, f"no prediction for {self._reply_timeout_s:.0f} s")
                raise ChainUnavailableError("the downstream pipeline stopped answering")
            started = time.perf_counter()
            self._cond.wait(remaining)
            self.counters.timeline.wait_s += time.perf_counter() - started

    def _start_lookahead(self, arrived: list[InflightStep], group_rows: int,
                         held: list[tuple[IterationRequest, int]],
                         steps: list[InflightStep]) -> float:
        """Run and ship the next decode step of sessions whose prediction just arrived.

        With measured step costs, steps are held in ``held``, by lane block
        (:attr:`block_lanes`), until no other step of the call in the same block is still
        awaited, so the block's rows go on as one batch; those still held when the call
        returns are left to the next call, which cuts its fresh rows again. Without step
        costs they go at once, in groups of ``group_rows``.
        """
        items = []
        for step in arrived:
            step.followed = True
            if (self._steps.get(step.session_id, step) is step
                    and step.session_id not in self._drafting
                    and self.local.session_token_count(step.session_id) == step.end):
                request = IterationRequest(step.session_id, [step.result.token],  # type: ignore[union-attr]
                                           sampling=step.sampling, sample_last=True,
                                           phase=RowPhase.DECODE)
                items.append((request, step.end))
        seconds = 0.0
        # Predictions that arrived together (several batches answered while this stage
        # computed) are shipped again in groups of the call's size, each as soon as it
        # is computed: merged into one batch they would stay merged, and the chain would
        # settle into one large group and one small one, each stage idle while the
        # other computes the large one. With measured step costs, predictions that come
        # back one small batch at a time would each go out as a batch of their own, and
        # the batches would stay that small: they are held until their lane block is
        # whole.
        if self.step_ms:
            held.extend(items)
            batches = self._ready_blocks(held, steps)
        else:
            parts = -(-len(items) // group_rows)
            batches = [[items[piece.index] for piece in group]
                       for group in split_token_groups([1] * len(items), parts)]
        for part in batches:
            try:
                seconds += self._ship(part, look_ahead=True)[1]
            except RuntimeFailure as exc:
                # Nothing changed (the runtime's guarantee): the scheduler's own call
                # will run these steps, or report the problem itself.
                logger.debug("look-ahead step skipped: %s", exc)
                continue
            self.counters.lookahead_steps += len(part)
        return seconds

    def _ready_blocks(self, held: list[tuple[IterationRequest, int]],
                      steps: list[InflightStep]) -> list[list[tuple[IterationRequest, int]]]:
        """Take out of ``held`` the lane blocks none of whose other steps in ``steps`` is
        still awaited, one batch each in lane order. Held steps are the local runtime's
        own sessions, so each has a lane."""
        size = max(1, self.block_lanes)
        blocks = [self._lane_rank(request) // size for request, _ in held]
        waiting = {lane // size for s in steps if s.result is None
                   if (lane := self.local.lane_of(s.session_id)) is not None}
        ready: dict[int, list[tuple[IterationRequest, int]]] = {}
        kept = []
        for item, block in zip(held, blocks, strict=True):
            if block in waiting:
                kept.append(item)
            else:
                ready.setdefault(block, []).append(item)
        held[:] = kept
        return [sorted(ready[block], key=lambda item: self._lane_rank(item[0]))
                for block in sorted(ready)]

    def _output(self, requests: Sequence[IterationRequest], needed: dict[int, InflightStep],
                compute_s: float) -> IterationOutput:
        samples = []
        with self._cond:
            for index, step in sorted(needed.items()):
                result = step.result
                assert result is not None
                samples.append(IterationSample(
                    index, result.token, result.is_eog,
                    followers=tuple(IterationSample(index, token, is_eog)
                                    for token, is_eog in result.followers),
                    drafted=result.drafted))
                if self._steps.get(step.session_id) is step:
                    del self._steps[step.session_id]  # consumed
        for step in needed.values():
            result = step.result
            assert result is not None
            if len(result.followers) < step.drafts:
                # The final stage kept the accepted drafts: so does this stage.
                self.local.trim_session(step.session_id, step.end + len(result.followers))
        return IterationOutput(output_rows=[None] * len(requests), samples=samples,
                               compute_s=compute_s)

    @property
    def inflight_batches(self) -> int:
        """Batches sent and not answered yet (at most :data:`MAX_INFLIGHT_BATCHES`)."""
        return len(self._batches)

    # -- listener callbacks (the link's reader thread) -------------------------------------

    def on_result(self, epoch: int, request_id: int, samples: Sequence[ChainSample]) -> None:
        """The final stage answered batch ``request_id``."""
        by_index = {sample.index: sample for sample in samples}
        with self._cond:
            batch = self._batches.get(request_id)
            if batch is None or batch.epoch != epoch:
                return
            del self._batches[request_id]
            self.counters.note_reply(time.monotonic() - batch.sent_at)
            for index, step in enumerate(batch.steps):
                if step is None:
                    continue
                step.result = by_index.get(index)
                if step.result is None:
                    step.error = ChainBatchError(
                        f"the final stage returned no prediction for entry {index}")
            self._cond.notify_all()

    def on_error(self, epoch: int, request_id: int, message: str) -> None:
        """A stage could not run batch ``request_id``."""
        with self._cond:
            batch = self._batches.pop(request_id, None)
            if batch is None or batch.epoch != epoch:
                return
            steps = [step for step in batch.steps if step is not None]
            for step in steps:
                step.error = ChainBatchError(f"a downstream stage failed a batch: {message}")
            if not steps:
                self._async_error = message  # raised by the next call
            self._cond.notify_all()

    def on_down(self, epoch: int, reason: str) -> None:
        """Connection ``epoch`` is gone: fail everything waiting on it."""
        with self._cond:
            for batch_id, batch in list(self._batches.items()):
                if batch.epoch != epoch:
                    continue
                del self._batches[batch_id]
                for step in batch.steps:
                    if step is not None and step.result is None:
                        step.error = ChainUnavailableError(
                            f"the downstream pipeline was lost: {reason}")
            self._cond.notify_all()


def _runs(sizes: Sequence[int]) -> list[list[Piece]]:
    """Consecutive one-row requests in groups of ``sizes`` rows."""
    groups, first = [], 0
    for size in sizes:
        groups.append([Piece(first + k, 0, 1) for k in range(size)])
        first += size
    return groups


def _piece(request: IterationRequest, start: int,
           piece: Piece) -> tuple[IterationRequest, int]:
    """Tokens ``piece`` of ``request`` (which starts at ``start``) as a request of its
    own; only the piece holding the last token samples."""
    if piece.begin == 0 and piece.end == len(request.token_ids):
        return request, start
    last = piece.end == len(request.token_ids)
    return IterationRequest(request.session_id, request.token_ids[piece.begin:piece.end],
                            sampling=request.sampling,
                            sample_last=request.sample_last and last,
                            phase=request.phase, lane=request.lane), start + piece.begin
