"""One CHAIN connection on a later stage: batches in, direct iterations, results out.

A *reader* thread decodes frames and submits each batch's entries to the worker without
waiting, so the worker computes while a *completer* thread, in arrival order, forwards
earlier batches' rows downstream or sends their predictions to stage 0. The reader
applies a DROP only once the session's queued iterations have run, so its lane is free
before the next batch asks for one. Every iteration carries a deadline and the
connection's closing event, so nothing runs or waits for a caller that is gone. A
neighbour silent for ``link.silence_timeout_s`` (``skippyd.link.liveness``) ends the
connection as a closed one does.
``docs/stage-protocol.md``, *What a later stage does*, has the rules.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from skippyd.engine.runtime.contract import RowPhase
from skippyd.engine.runtime.pipeline_types import ChainEntry, ChainSample
from skippyd.engine.worker.direct_batch import (
    DirectGroup,
    DirectIteration,
    IterationOutcome,
    resolve_future,
)
from skippyd.engine.worker.worker_errors import QueueFullError, WorkerError
from skippyd.link.dialer import dial
from skippyd.link.framing import BatchAssembler, FrameSocket
from skippyd.link.handshake import Hello, HelloAck, Role, send_ack
from skippyd.link.probe import link_view
from skippyd.link.wire import (
    Frame,
    FrameKind,
    LinkLimits,
    LinkProtocolError,
    encode_drop,
    encode_iteration,
    encode_result,
    encode_text,
)

if TYPE_CHECKING:
    from skippyd.engine.worker.handle import BatchHandle
    from skippyd.link.listener import StageLinkServer

logger = logging.getLogger(__name__)

#: Batches read ahead of the completer; beyond it the reader stops reading (back-pressure).
MAX_QUEUED_BATCHES = 32
#: How long the final stage waits for stage 0's RETURN connection.
RETURN_WAIT_S = 10.0
#: How long a submit keeps retrying while the worker's command queue is full.
SUBMIT_RETRY_S = 10.0
#: A frame's body must arrive within this time of its header (64 MiB at ~20 Mbit/s).
FRAME_BODY_TIMEOUT_S = 30.0


class _Refusal(Exception):
    """The chain cannot be served; the message goes back to the upstream stage."""


@dataclass(slots=True)
class _Pending:
    request_id: int
    entries: list[ChainEntry]
    iterations: list[DirectIteration]
    half_rows: bool
    """The rows came as float16: a middle stage forwards its own rows the same way."""
    submitted_at: float
    """``time.monotonic()`` when the batch's entries were queued on the worker."""


@dataclass(slots=True)
class _Drop:
    wire_id: int


@dataclass(slots=True)
class _Relay:
    request_id: int
    message: str


_STOP = object()


class ChainConnection:
    """Serves one authenticated CHAIN connection; see the module docstring."""

    def __init__(self, server: StageLinkServer, upstream: FrameSocket, hello: Hello,
                 nonces: tuple, peer: str) -> None:
        self.chain_id = hello.chain_id
        self._server = server
        self._facts = server.facts
        worker = server.worker
        if worker is None:  # the listener accepts chains only with a batch worker
            raise ValueError("a chain connection needs the stage's batch worker")
        self._worker: BatchHandle = worker
        self._upstream = upstream
        self._hello = hello
        self._nonces = nonces
        self._peer = peer
        self._downstream: FrameSocket | None = None
        self._return: FrameSocket | None = None
        self._return_ready = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=MAX_QUEUED_BATCHES)
        self._names: dict[int, str] = {}
        self._incarnations: dict[int, int] = {}
        self._live: set[str] = set()
        self._outstanding: dict[str, list[DirectIteration]] = {}
        stall_s = server.worker.settings.stall_timeout_s if server.worker is not None else 0.0
        self._iteration_timeout_s = stall_s if stall_s > 0 else None
        """How long one iteration may take from its submission (None: no limit)."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._close_reason: str | None = None
        self._batches = 0

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        """Set the chain up, then read until the connection ends (caller's thread)."""
        try:
            ack = self._setup()
        except _Refusal as exc:
            self._server.refuse(self._upstream, self._peer, str(exc))
            self._close_sockets()
            return
        if not self._server.register(self):
            self._server.refuse(self._upstream, self._peer, "this stage already serves "
                                f"link.max_chains={self._facts.max_chains} chain(s)")
            self._close_sockets()
            return
        send_ack(self._upstream, self._facts.secret, self._nonces, ack)
        limits = LinkLimits(max_frame_bytes=self._facts.max_frame_bytes,
                            row_width=self._facts.n_embd,
                            max_context_tokens=self._facts.session_tokens)
        self._upstream.limits = limits
        self._upstream.sock.settimeout(None)
        # Idle between frames is fine; stalling inside one is not.
        self._upstream.body_timeout_s = FRAME_BODY_TIMEOUT_S
        # A neighbour that stops answering without closing (a stopped process, a lost
        # machine) ends the chain as a closed connection would.
        pinger = self._server.pinger
        pinger.watch(self._upstream, "the upstream stage", self.close)
        if self._downstream is not None:
            pinger.watch(self._downstream, self._facts.downstream_id or "downstream",
                         self.close)
        logger.info("chain connection from %s accepted (%d stage(s) from here to the end)",
                    self._peer, ack.num_stages)
        completer = threading.Thread(target=self._complete_loop, daemon=True,
                                     name=f"skippyd-link-completer-{self._peer}")
        completer.start()
        if self._downstream is not None:
            threading.Thread(target=self._watch_downstream, daemon=True,
                             name=f"skippyd-link-watch-{self._peer}").start()
        self.close(self._read_loop())
        self._queue.put(_STOP)
        completer.join()
        self._server.unregister(self, self.counters())

    def close(self, reason: str) -> None:
        """End the connection (first reason wins); safe from any thread."""
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
            self._close_reason = reason
        logger.info("chain connection from %s closed: %s", self._peer, reason)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in (self._upstream, self._downstream, self._return):
            if conn is not None:
                self._server.pinger.remove(conn)
                conn.close()

    def attach_return(self, conn: FrameSocket) -> bool:
        """Use ``conn`` (opened by stage 0) for predictions; False if not possible."""
        with self._lock:
            if self._closing.is_set() or self._return is not None:
                return False
            self._return = conn
        self._server.pinger.watch(conn, "stage 0 (return connection)", self.close)
        self._return_ready.set()
        return True

    def links(self) -> list[dict[str, Any]]:
        """Round trips and send queues of this chain's connections (``link.probe``)."""
        facts = self._facts
        views = [link_view(self._upstream, self._peer, "upstream")]
        if not facts.is_final:
            views.append(link_view(self._downstream, facts.downstream_id or "downstream",
                                   "downstream"))
        else:
            views.append(link_view(self._return, "stage 0", "return"))
        return views

    @property
    def queued_batches(self) -> int:
        """Batches read and not yet finished (their results not yet sent)."""
        return self._queue.qsize()

    def counters(self) -> dict[str, int]:
        conns = [c for c in (self._upstream, self._downstream, self._return) if c is not None]
        return {"bytes_in": sum(c.bytes_in for c in conns),
                "bytes_out": sum(c.bytes_out for c in conns), "batches": self._batches}

    # -- setup -----------------------------------------------------------------------------

    def _setup(self) -> HelloAck:
        facts, hello = self._facts, self._hello
        for ok, problem in (
            (hello.model_id == facts.model_id,
             f"upstream serves model {hello.model_id!r}, this stage {facts.model_id!r}"),
            (hello.stage_index == facts.stage_index - 1,
             f"upstream is stage index {hello.stage_index}, this stage expects "
             f"{facts.stage_index - 1}"),
            (hello.layer_end == facts.layer_start,
             f"upstream ends at layer {hello.layer_end}, this stage starts at "
             f"{facts.layer_start}"),
            (hello.n_embd == facts.n_embd,
             f"upstream sends rows of width {hello.n_embd}, this stage takes {facts.n_embd}"),
        ):
            if not ok:
                raise _Refusal(problem)
        if facts.is_final:
            return HelloAck(1, facts.lanes, facts.session_tokens, facts.max_batch_tokens,
                            self._server.return_endpoint(self._upstream), facts.stage_id)
        return self._extend_chain()

    def _extend_chain(self) -> HelloAck:
        """Dial the next stage with the same chain id; fold its answer into ours."""
        facts = self._facts
        assert facts.downstream is not None
        hello = Hello(Role.CHAIN, self.chain_id, facts.n_embd, facts.stage_index,
                      facts.layer_end, facts.model_id)
        try:
            self._downstream, ack = dial(facts.downstream, facts.secret, hello,
                                         facts.connect_timeout_s, tls=facts.tls,
                                         expect_id=facts.downstream_id)
        except (OSError, LinkProtocolError) as exc:
            raise _Refusal(f"{facts.downstream_id} at {facts.downstream[0]}:"
                           f"{facts.downstream[1]}: {exc}") from None
        return HelloAck(ack.num_stages + 1, min(facts.lanes, ack.min_lanes),
                        min(facts.session_tokens, ack.min_session_tokens),
                        min(facts.max_batch_tokens, ack.min_batch), ack.return_endpoint,
                        ack.final_stage_id)

    def _watch_downstream(self) -> None:
        """Only probes come back on the downstream connection: anything else ends it."""
        downstream = self._downstream
        assert downstream is not None
        try:
            while (frame := downstream.read()) is not None and downstream.answer_probe(frame):
                pass
            reason = ("the downstream stage closed the connection" if frame is None
                      else f"unexpected {frame.kind.name} frame from downstream")
        except (LinkProtocolError, OSError) as exc:
            reason = f"downstream connection failed: {exc}"
        self.close(reason)

    # -- reader ----------------------------------------------------------------------------

    def _read_loop(self) -> str:
        assembler = BatchAssembler()
        try:
            while not self._closing.is_set():
                frame = self._upstream.read()
                if frame is None:
                    return "the upstream stage closed the connection"
                self._dispatch(frame, assembler)
        except LinkProtocolError as exc:
            logger.warning("closing chain connection from %s: %s", self._peer, exc)
            return f"protocol error: {exc}"
        except OSError as exc:
            return self._close_reason or f"upstream connection failed: {exc}"
        return self._close_reason or "closed"

    def _dispatch(self, frame: Frame, assembler: BatchAssembler) -> None:
        kind = frame.kind
        if not assembler.open and self._upstream.answer_probe(frame):
            return
        if kind is FrameKind.ITERATION:
            done = assembler.add(frame)
            if done is not None:
                self._submit_batch(*done)
            return
        if assembler.open:
            raise LinkProtocolError(f"{kind.name} frame inside an unfinished batch")
        if kind is FrameKind.DROP:
            self._drop(frame.header.session_id)
        elif kind is FrameKind.ERROR:
            if frame.header.request_id == 0:  # for no batch: a stage upstream failed
                logger.warning("the chain from %s reports: %s", self._peer, frame.payload)
            self._queue.put(_Relay(frame.header.request_id, str(frame.payload)))
        else:
            raise LinkProtocolError(f"unexpected {kind.name} frame on a chain connection")

    def _submit_batch(self, request_id: int, entries: list[ChainEntry],
                      half_rows: bool) -> None:
        final = self._facts.is_final
        iterations = []
        timeout_s = self._iteration_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Stage 0's decode groups arrive as batches: each runs whole and alone here too.
        group = DirectGroup((self.chain_id, request_id), len(entries))
        for entry in entries:
            name = self._session_name(entry.session_id)
            # The final stage verifies an entry's drafts; a middle stage computes their
            # rows like any others (the next entry trims what was rejected).
            drafts = entry.draft_count if final else 0
            inputs = len(entry.token_ids) - drafts
            iteration = DirectIteration(
                session_id=name, token_ids=entry.token_ids[:inputs],
                positions=list(entry.positions)[:inputs],
                sampling=entry.sampling if final else None, input_rows=entry.rows,
                sample_last=entry.sample_last and final,
                draft=entry.token_ids[inputs:],
                phase=RowPhase.DECODE if entry.decode else RowPhase.PREFILL,
                # Trim a session that is ahead (a retracted look-ahead step); never
                # extend one (session alignment).
                target_token_count=entry.first_position, group=group,
                deadline=deadline, cancelled=self._closing, lane=entry.lane,
            )
            self._submit(iteration)
            iterations.append(iteration)
            pending = [i for i in self._outstanding.get(name, []) if not i.reply.done()]
            self._outstanding[name] = [*pending, iteration]
        self._queue.put(_Pending(request_id, entries, iterations, half_rows, time.monotonic()))

    def _drop(self, wire_id: int) -> None:
        """Free a session on the worker before anything after the DROP is submitted."""
        self._incarnations[wire_id] = self._incarnations.get(wire_id, 0) + 1
        name = self._names.pop(wire_id, None)
        if name is not None:
            # Queued now, the drop could overtake the session's own queued iterations
            # (the worker applies a drop as it dequeues it): wait for those first. Past
            # their deadline none of them can run any more, so that wait is bounded.
            outstanding = self._outstanding.pop(name, [])
            deadlines = [i.deadline for i in outstanding if i.deadline is not None]
            timeout = (None if not outstanding or len(deadlines) < len(outstanding)
                       else max(0.0, max(deadlines) - time.monotonic()))
            futures_wait([i.reply for i in outstanding], timeout=timeout)
            self._free(name)
        self._queue.put(_Drop(wire_id))  # forwarded downstream in order

    def _session_name(self, wire_id: int) -> str:
        name = self._names.get(wire_id)
        if name is None:
            incarnation = self._incarnations.get(wire_id, 0)
            name = self._names[wire_id] = f"link{self.chain_id:x}.{wire_id}.{incarnation}"
            self._live.add(name)
        return name

    def _submit(self, iteration: DirectIteration) -> None:
        """Queue ``iteration`` on the worker; a refusal becomes its reply."""
        deadline = time.monotonic() + SUBMIT_RETRY_S
        while True:
            try:
                self._worker.submit_iteration(iteration)
                return
            except QueueFullError as exc:
                # Back-pressure: the worker drains its command queue every turn.
                if time.monotonic() > deadline or self._closing.wait(0.001):
                    resolve_future(iteration.reply, error=exc)
                    return
            except WorkerError as exc:
                resolve_future(iteration.reply, error=exc)
                return

    # -- completer -------------------------------------------------------------------------

    def _complete_loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            try:
                self._complete(item)
            except OSError as exc:
                self.close(f"sending failed: {exc}")
            except Exception as exc:  # a bug: end this connection, never the completer
                logger.exception("chain connection from %s failed", self._peer)
                self.close(f"internal error: {exc!r}")
        for name in list(self._live):
            self._free(name)

    def _complete(self, item: Any) -> None:
        if isinstance(item, _Drop):
            if self._downstream is not None and not self._closing.is_set():
                self._downstream.write(encode_drop(item.wire_id))
        elif isinstance(item, _Relay):
            if not self._closing.is_set():
                self._send_error(item.request_id, item.message)
        else:
            self._finish_batch(item)

    def _finish_batch(self, pending: _Pending) -> None:
        outcomes: list[IterationOutcome] = []
        error: str | None = None
        for iteration in pending.iterations:
            try:
                outcomes.append(iteration.outcome())
            except WorkerError as exc:  # the batch fails whole: no outcome kept
                error = error or f"{self._facts.stage_id}: {exc.message}"
        self._batches += 1
        if self._closing.is_set():
            return
        if error is not None:
            self._send_error(pending.request_id, error)
            return
        started = time.perf_counter()
        self._note_timeline(pending, outcomes)
        if self._facts.is_final:
            samples = [ChainSample(i, o.predicted, o.is_eog, o.followers, o.drafted)
                       for i, (e, o) in enumerate(zip(pending.entries, outcomes, strict=True))
                       if e.sample_last]
            data = encode_result(pending.request_id, samples)
        else:
            last = len(pending.entries) - 1
            data = b"".join(
                encode_iteration(pending.request_id, replace(e, rows=o.output_rows),
                                 end_of_batch=i == last, half_rows=pending.half_rows)
                for i, (e, o) in enumerate(zip(pending.entries, outcomes, strict=True)))
        encoded = time.perf_counter()
        if self._facts.is_final:
            self._send_return(data)
        else:
            assert self._downstream is not None
            self._downstream.write(data)
        timeline = self._server.timeline
        timeline.encode_s += encoded - started
        timeline.send_s += time.perf_counter() - encoded

    def _note_timeline(self, pending: _Pending, outcomes: list) -> None:
        """Add a finished batch's queue wait and completer lag to the stage's timeline.

        The entries of one batch usually run in one worker call; when they were split
        over several, the last one to finish sets the lag.
        """
        finished = max(pending.submitted_at + (o.batch_wait_ms + o.run_ms) / 1000.0
                       for o in outcomes)
        timeline = self._server.timeline
        timeline.batches += 1
        timeline.wait_s += max(o.batch_wait_ms for o in outcomes) / 1000.0
        timeline.reply_s += max(0.0, time.monotonic() - finished)

    def _send_error(self, request_id: int, message: str) -> None:
        data = encode_text(FrameKind.ERROR, message, request_id=request_id)
        if self._facts.is_final:
            self._send_return(data)
        else:
            assert self._downstream is not None
            self._downstream.write(data)

    def _send_return(self, data: bytes) -> None:
        if not self._return_ready.wait(RETURN_WAIT_S):
            raise OSError(f"stage 0 opened no return connection within {RETURN_WAIT_S:.0f} s")
        assert self._return is not None
        self._return.write(data)

    def _free(self, name: str) -> None:
        """Drop a runtime session on the worker (never lost, even with its queue full).

        Precondition: none of the session's iterations can still run on the worker.
        """
        self._live.discard(name)
        self._worker.drop_session(name)
