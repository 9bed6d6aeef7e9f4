"""The lanes of one llama.cpp context and the sessions bound to them.

Each lane is one llama.cpp sequence id, with a KV stream of its own or a share of one
pool all lanes use. A session is bound to a lane while it is active; the lane keeps its
KV after its session ends, until it is given to another session (or the pool needs the
cells), so the prefix cache can reuse it: in place (:meth:`LaneTable.bind` with
``keep_tokens``: a hit costs nothing), from another lane (:meth:`LaneTable.copy_prefix`),
or for the choices of one request (:meth:`LaneTable.fork`). Which prefix goes where is
the prefix cache's business, not this table's. Only the worker thread may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.contract import (
    DecodeFailedError,
    InvalidIterationError,
    LanesBusyError,
)
from skippyd.engine.runtime.host_state import HostState, HostStates
from skippyd.engine.runtime.sampling import SamplerChain


@dataclass(slots=True)
class Lane:
    """One sequence id and its KV stream; holds its KV after its session ends."""

    seq_id: int
    session_id: str | None = None
    """The active session bound to the lane, or None while it is idle."""
    token_count: int = 0
    history: list[int] = field(default_factory=list)
    """Token ids in KV order (first stage, or a token sideband on later stages)."""
    sampler: SamplerChain | None = None
    prompt_carry: tuple[int, np.ndarray] | None = None
    """(position, logits) of a prefill chunk's last row, whose next token the following
    chunk brings (``prompt_logprobs`` sessions only)."""

    def reset_sampler(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


class LaneTable:
    """Lanes, the sessions bound to them, and every change to their KV sequences.

    Args:
        mem: The context's memory (``llama_get_memory``).
        host_states: Saves and loads lane states (for :meth:`copy_prefix`).
        lane_count: Lanes (sequence ids ``0 … lane_count-1``).
        unified: The lanes share one KV pool (copies share cells) instead of having a
            stream each.
    """

    def __init__(self, mem, host_states: HostStates, lane_count: int, *,
                 unified: bool = False) -> None:
        self._mem = mem
        self._unified = unified
        self._host_states = host_states
        self.lanes = [Lane(seq_id) for seq_id in range(lane_count)]
        self.sessions: dict[str, Lane] = {}
        """Active session id -> its lane."""

    # -- reading ---------------------------------------------------------------------
    def require(self, session_id: str) -> Lane:
        """The lane of an active session.

        Raises:
            InvalidIterationError: The session is not active.
        """
        lane = self.sessions.get(session_id)
        if lane is None:
            raise InvalidIterationError(f"unknown session {session_id}")
        return lane

    def lane(self, seq_id: int) -> Lane:
        """Lane ``seq_id``.

        Raises:
            InvalidIterationError: No such lane.
        """
        if not 0 <= seq_id < len(self.lanes):
            raise InvalidIterationError(f"no lane {seq_id} (lanes 0..{len(self.lanes) - 1})")
        return self.lanes[seq_id]

    def idle(self) -> list[Lane]:
        """Lanes no session is bound to, lowest first."""
        return [lane for lane in self.lanes if lane.session_id is None]

    def cells_used(self) -> int:
        """Cells held by active sessions (idle lanes' kept KV is the prefix cache's)."""
        return sum(lane.token_count for lane in self.sessions.values())

    # -- binding ---------------------------------------------------------------------
    def bind(self, session_id: str, seq_id: int | None = None, keep_tokens: int = 0) -> Lane:
        """Bind a new session to an idle lane; an active one keeps its lane.

        Args:
            session_id: The session.
            seq_id: The idle lane to take; default: the lowest idle lane holding
                nothing, else the lowest idle lane.
            keep_tokens: Leading tokens of the lane's kept KV the session starts with
                (the prefix cache restoring in place); the rest is cleared.

        Raises:
            LanesBusyError: No lane is idle.
            InvalidIterationError: ``seq_id`` is not an idle lane, or it holds fewer than
                ``keep_tokens`` tokens.
        """
        bound = self.sessions.get(session_id)
        if bound is not None:
            return bound
        chosen = self._pick() if seq_id is None else self._idle_lane(seq_id)
        if not 0 <= keep_tokens <= chosen.token_count:
            raise InvalidIterationError(f"lane {chosen.seq_id} holds {chosen.token_count} "
                                        f"tokens, cannot keep {keep_tokens}")
        self.remove_from(chosen, keep_tokens)
        chosen.prompt_carry = None  # a lane's last session may have left one
        chosen.session_id = session_id
        self.sessions[session_id] = chosen
        return chosen

    def release(self, session_id: str) -> None:
        """End the session and free its lane, which keeps its KV until it is reused.

        Unknown ids are ignored.
        """
        lane = self.sessions.pop(session_id, None)
        if lane is None:
            return
        lane.session_id = None
        lane.reset_sampler()

    def _pick(self) -> Lane:
        idle = self.idle()
        if not idle:
            raise LanesBusyError("all execution lanes are busy")
        empty = [lane for lane in idle if lane.token_count == 0]
        return (empty or idle)[0]

    def _idle_lane(self, seq_id: int) -> Lane:
        if not 0 <= seq_id < len(self.lanes) or self.lanes[seq_id].session_id is not None:
            raise InvalidIterationError(f"lane {seq_id} is not an idle lane")
        return self.lanes[seq_id]

    # -- KV --------------------------------------------------------------------------
    def remove_from(self, lane: Lane, position: int) -> None:
        """Drop the lane's KV from ``position`` on (its whole KV for 0)."""
        L.llama_memory_seq_rm(self._mem, lane.seq_id, position, -1)
        lane.token_count = min(lane.token_count, position)
        del lane.history[position:]
        lane.reset_sampler()

    def set_history(self, lane: Lane, tokens: Sequence[int]) -> None:
        """Record that the lane's KV now holds ``tokens`` (after a copy or a load)."""
        lane.token_count = len(tokens)
        lane.history = list(tokens)
        lane.reset_sampler()

    def clear(self, seq_id: int) -> None:
        """Forget what an idle lane kept."""
        self.remove_from(self._idle_lane(seq_id), 0)

    def fork(self, src_session_id: str, dst_session_id: str, num_tokens: int | None) -> None:
        """Make ``dst`` hold ``src``'s first ``num_tokens`` tokens (all by default).

        For the choices of one request (``n > 1``), which share their prompt. The whole
        sequence is copied (``llama_memory_seq_cp`` over every position: in a unified
        cache that shares cells, across KV streams it copies the stream at the next
        decode, which is the copy's only reader), then ``dst`` is trimmed to
        ``num_tokens``.

        Raises:
            InvalidIterationError: ``src`` is unknown, holds too few tokens or is ``dst``.
            LanesBusyError: ``dst`` is new and no lane is free.
        """
        src = self.require(src_session_id)
        count = src.token_count if num_tokens is None else num_tokens
        if src_session_id == dst_session_id or not 0 < count <= src.token_count:
            raise InvalidIterationError(
                f"fork_session: cannot copy {count} tokens of {src_session_id} (holding"
                f" {src.token_count}) into {dst_session_id}")
        dst = self.bind(dst_session_id)
        L.llama_memory_seq_rm(self._mem, dst.seq_id, -1, -1)
        L.llama_memory_seq_cp(self._mem, src.seq_id, dst.seq_id, -1, -1)
        if count < src.token_count:
            L.llama_memory_seq_rm(self._mem, dst.seq_id, count, -1)
        self.set_history(dst, src.history[:count])

    def copy_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        """Make the session hold the first ``num_tokens`` tokens of lane ``source``.

        The session's lane must hold nothing the session needs: it is replaced. From its
        own lane this only trims. From another lane in one pool, ``llama_memory_seq_cp``
        makes the session's sequence share the prefix's cells (no copy, no extra memory);
        between streams the lane's KV goes through a saved state, because
        ``llama_memory_seq_cp`` across streams copies the whole stream, and only at the
        next ``llama_decode``, so a state saved or loaded in between would see stale cells.

        Raises:
            InvalidIterationError: Unknown session or lane, or a count the lane lacks.
            DecodeFailedError: llama.cpp could not copy the state.
        """
        target = self.require(session_id)
        origin = self.lane(source)
        if not 0 < num_tokens <= origin.token_count:
            raise InvalidIterationError(
                f"copy_lane_prefix: {num_tokens} tokens requested, lane {source} holds"
                f" {origin.token_count}")
        tokens = origin.history[:num_tokens]
        if origin is not target and self._unified:
            # One pool: the target's sequence id joins the prefix's cells, nothing moves.
            L.llama_memory_seq_rm(self._mem, target.seq_id, -1, -1)
            L.llama_memory_seq_cp(self._mem, origin.seq_id, target.seq_id, 0, num_tokens)
        elif origin is not target:
            state = self._host_states.save(origin.seq_id)
            try:
                if not self.load(target, state, origin.history):
                    raise DecodeFailedError(f"copying lane {source} into session {session_id}:"
                                            " llama.cpp could not load the state")
            finally:
                state.release()
        L.llama_memory_seq_rm(self._mem, target.seq_id, num_tokens, -1)
        self.set_history(target, tokens)

    def load(self, lane: Lane, state: HostState, tokens: Sequence[int]) -> bool:
        """Replace the lane's KV with a saved state holding ``tokens``.

        Returns:
            False when llama.cpp could not load it; the lane is then empty.
        """
        L.llama_memory_seq_rm(self._mem, lane.seq_id, -1, -1)
        if not self._host_states.load(lane.seq_id, state):
            L.llama_memory_seq_rm(self._mem, lane.seq_id, -1, -1)
            self.set_history(lane, ())
            return False
        self.set_history(lane, tokens)
        return True

    def close(self) -> None:
        for lane in self.lanes:
            lane.reset_sampler()
        self.sessions.clear()
