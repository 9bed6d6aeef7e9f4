"""A scripted, in-memory Runtime for scheduling tests (no llama.cpp).

It follows the runtime contract of ``skippyd.engine.runtime.contract``: sessions bound to a
fixed number of lanes, a shared KV pool counted in tokens, batched calls that either
apply entirely or raise and change nothing. Sampled tokens come from a per-session
script, else a deterministic default. Tests can block a call on ``gate``, see that a
call started through ``entered``, and queue exceptions in ``failures``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationOutput,
    IterationRequest,
    IterationSample,
    KvSlotUnavailableError,
    LanesBusyError,
    SessionAlignment,
)
from skippyd.engine.runtime.watch import unwatched
from skippyd.engine.worker.generation_events import AdmittedEvent, GenerationEvent

GATE_TIMEOUT_S = 10.0


class FakeRuntime:
    """A deterministic stand-in for ``LlamaRuntime``; worker thread only, like the real one.

    Args:
        lane_count: Execution lanes (max concurrent sessions).
        kv_pool_tokens: Shared KV pool size in tokens.
        n_batch: Most tokens per call (``max_batch_tokens``).
        n_ubatch: Tokens per graph run (``micro_batch_tokens``).
        script: Tokens to sample per session, in order.
        eog_tokens: Tokens reported with ``is_eog``.
        default_token: Token sampled once a session's script is exhausted, as a function
            of the request; defaults to ``100 + the session's new token count``.
        invalid_tokens: Token ids the "vocabulary" rejects (``InvalidIterationError``).
    """

    def __init__(
        self,
        lane_count: int = 4,
        kv_pool_tokens: int = 4096,
        *,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        script: dict[str, Iterable[int]] | None = None,
        eog_tokens: Iterable[int] = (),
        default_token: Callable[[IterationRequest, int], int] | None = None,
        invalid_tokens: Iterable[int] = (),
    ) -> None:
        self._lane_count = lane_count
        self._kv_pool_tokens = kv_pool_tokens
        self._n_batch = n_batch
        self._n_ubatch = n_ubatch
        self.closed = False
        self.sessions: dict[str, int] = {}
        self.calls: list[list[IterationRequest]] = []
        self.script = {sid: deque(tokens) for sid, tokens in (script or {}).items()}
        self.eog_tokens = set(eog_tokens)
        self.default_token = default_token or (lambda _request, count: 100 + count)
        self.failures: deque[BaseException] = deque()
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.dropped: list[str] = []
        self.invalid_tokens = set(invalid_tokens)
        self.watch = unwatched()

    # -- facts -------------------------------------------------------------------------

    @property
    def lane_count(self) -> int:
        return self._lane_count

    @property
    def kv_pool_tokens(self) -> int:
        return self._kv_pool_tokens

    @property
    def max_batch_tokens(self) -> int:
        return self._n_batch

    @property
    def micro_batch_tokens(self) -> int:
        return self._n_ubatch

    @property
    def max_session_tokens(self) -> int:
        return self._kv_pool_tokens

    def active_session_count(self) -> int:
        return len(self.sessions)

    def kv_cells_used(self) -> int:
        return sum(self.sessions.values())

    def session_token_count(self, session_id: str) -> int | None:
        return self.sessions.get(session_id)

    def close(self) -> None:
        self.closed = True

    # -- what the fake does not do: forks, hooks, a prefix cache ------------------------

    def set_compute_hook(self, hook) -> bool:
        return False

    @property
    def can_fork(self) -> bool:
        return False

    def fork_session(self, src_session_id: str, dst_session_id: str,
                     num_tokens: int | None = None) -> None:
        raise InvalidIterationError("the fake runtime cannot fork")

    @property
    def keeps_lane_kv(self) -> bool:
        return False

    @property
    def shares_kv_pool(self) -> bool:
        return False

    def clear_lane(self, lane: int) -> None:
        raise InvalidIterationError("the fake runtime keeps no lane KV")

    def session_history(self, session_id: str) -> tuple[int, ...]:
        return ()

    def lane_history(self, lane: int) -> tuple[int, ...]:
        return ()

    def lane_of(self, session_id: str) -> int | None:
        return sorted(self.sessions).index(session_id) if session_id in self.sessions else None

    def idle_lanes(self) -> list[int]:
        return list(range(len(self.sessions), self._lane_count))

    def copy_lane_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        raise InvalidIterationError("the fake runtime keeps no lane KV")

    def save_lane_state(self, lane: int, size: int | None = None):
        raise InvalidIterationError("the fake runtime keeps no lane KV")

    def lane_state_bytes(self, lane: int) -> int:
        raise InvalidIterationError("the fake runtime keeps no lane KV")

    def load_session_state(self, session_id: str, state, tokens) -> bool:
        raise InvalidIterationError("the fake runtime keeps no lane KV")

    # -- sessions ----------------------------------------------------------------------

    def ensure_session_active(self, session_id: str) -> None:
        if session_id in self.sessions:
            return
        if len(self.sessions) >= self._lane_count:
            raise LanesBusyError("all execution lanes are busy")
        self.sessions[session_id] = 0

    def drop_session(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is not None:
            self.dropped.append(session_id)

    def trim_session(self, session_id: str, token_count: int) -> None:
        if session_id not in self.sessions:
            raise InvalidIterationError(f"unknown session {session_id}")
        self.sessions[session_id] = min(self.sessions[session_id], token_count)

    def align_session_to_token_count_if_ahead(
        self, session_id: str, target: int
    ) -> SessionAlignment | None:
        count = self.sessions.get(session_id)
        if count is None or count <= target:
            return None
        self.trim_session(session_id, target)
        return SessionAlignment(before_token_count=count, after_token_count=target)

    # -- iterations --------------------------------------------------------------------

    def run_iteration(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        self.entered.set()
        if self.gate is not None and not self.gate.wait(GATE_TIMEOUT_S):
            raise AssertionError("FakeRuntime gate was never released")
        if self.failures:
            raise self.failures.popleft()
        if not requests:
            return IterationOutput()
        starts = self._validate(requests)
        output = IterationOutput(output_rows=[None] * len(requests))
        for index, (request, start) in enumerate(zip(requests, starts, strict=True)):
            count = start + request.num_tokens
            self.sessions[request.session_id] = count
            if request.sample_last:
                token = self._next_token(request, count)
                followers: list[IterationSample] = []
                last = token
                # Drafts are kept while each is the token sampled before it, as llama.cpp
                # verifies them; the session then holds the accepted ones too.
                for draft in request.draft:
                    if last != draft or last in self.eog_tokens:
                        break
                    count += 1
                    last = self._next_token(request, count)
                    followers.append(IterationSample(index, last, last in self.eog_tokens))
                self.sessions[request.session_id] = count
                output.samples.append(IterationSample(index, token, token in self.eog_tokens,
                                                      followers=tuple(followers),
                                                      drafted=len(request.draft)))
        self.calls.append(list(requests))
        return output

    def _validate(self, requests: Sequence[IterationRequest]) -> list[int]:
        ids = [request.session_id for request in requests]
        if len(set(ids)) != len(ids):
            raise InvalidIterationError("iteration contains duplicate session")
        new = [sid for sid in ids if sid not in self.sessions]
        if len(new) > self._lane_count - len(self.sessions):
            raise LanesBusyError(f"iteration requires {len(new)} new sessions")
        starts = []
        for request in requests:
            if self.invalid_tokens.intersection(request.token_ids):
                raise InvalidIterationError(
                    f"session {request.session_id}: token id outside the vocabulary"
                )
            current = self.sessions.get(request.session_id, 0)
            start = request.positions[0] if request.positions else current
            if start > current:
                raise InvalidIterationError(f"session {request.session_id}: gap at {start}")
            starts.append(start)
        after = dict(self.sessions)
        for request, start in zip(requests, starts, strict=True):
            after[request.session_id] = start + request.num_rows
        if sum(after.values()) > self._kv_pool_tokens:
            raise KvSlotUnavailableError(f"no KV slot ({sum(after.values())} tokens)")
        return starts

    def _next_token(self, request: IterationRequest, count: int) -> int:
        script = self.script.get(request.session_id)
        if script:
            return script.popleft()
        return self.default_token(request, count)

    def sampled_sessions(self) -> list[list[str]]:
        """Per call, the sessions that sampled (handy for batching assertions)."""
        return [[r.session_id for r in call if r.sample_last] for call in self.calls]


class EventRecorder:
    """An ``on_event`` callback that collects a generation's events for a test.

    Admission events are kept apart, in ``admitted`` (the order of the others is what
    most tests look at).
    """

    def __init__(self) -> None:
        self.events: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        self.admitted: list[AdmittedEvent] = []

    def __call__(self, event: GenerationEvent) -> None:
        if isinstance(event, AdmittedEvent):
            self.admitted.append(event)
        else:
            self.events.put(event)

    def next(self, timeout_s: float = GATE_TIMEOUT_S) -> GenerationEvent:
        """The next event, waiting up to ``timeout_s`` (raises ``queue.Empty``)."""
        return self.events.get(timeout=timeout_s)

    def pending(self) -> list[GenerationEvent]:
        """Events already delivered, without waiting."""
        events = []
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events


def wait_until(predicate: Callable[[], bool], timeout_s: float = GATE_TIMEOUT_S) -> bool:
    """Poll a cross-thread condition every millisecond, bounded by ``timeout_s``."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        tick.wait(0.001)
    return True
