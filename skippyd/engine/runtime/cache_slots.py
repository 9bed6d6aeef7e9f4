"""Prefix-cache slots of :class:`~skippyd.engine.runtime.llama.LlamaRuntime` (DESIGN.md item 9).

A slot is a sequence id reserved beyond the lanes (``RuntimeOptions.reserved_seq_ids``).
These methods only move KV between lanes and slots, or between a slot and host memory;
which prefix goes where is the prefix cache's business, not the runtime's. Only the
worker thread may call them.

* ``llama_memory_seq_cp`` adds a sequence id to existing cells: a copy shares cells and
  costs nothing, and a copy of the first ``n`` positions is a valid ``n``-token prefix.
* ``llama_state_seq_get_data_ext`` / ``set_data_ext`` save a sequence to host memory and
  load it into another sequence id; a load needs free cells for the whole saved state.

A saved state lives in an anonymous memory mapping of its own (:class:`HostState`), not on
the malloc heap: states of every size come and go as the host tier churns, and on the
heap they fragmented it, so a long-running daemon's memory crept up although the tier
stayed within its budget. A mapping goes back to the system the moment it is dropped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.protocol import DecodeFailedError, InvalidIterationError

logger = logging.getLogger(__name__)

#: ``llama_state_seq_*_ext`` flags: 0 saves every layer's KV of the sequence.
_STATE_FLAGS = 0


class HostState:
    """A saved sequence state in an anonymous mapping; ``len()`` is its size in bytes.

    The mapping is unmapped when the object is collected (or :meth:`release` is called).
    """

    __slots__ = ("_map", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, max(size, 1))

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Host RAM the mapping takes: the size rounded up to whole pages."""
        return -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE

    def as_ctypes(self) -> ctypes.Array:
        """The state's bytes as a ctypes array over the mapping (no copy)."""
        return (ctypes.c_uint8 * self.size).from_buffer(self._map)

    def release(self) -> None:
        """Unmap now. Idempotent; a released state reads as empty."""
        self.size = 0
        self._map.close()


class CacheSlotsMixin:
    """Slot operations; mixed into ``LlamaRuntime`` (uses its context and sessions)."""

    @property
    def cache_slot_ids(self) -> range:
        """The reserved sequence ids, right after the lanes."""
        start = self.options.lane_count
        return range(start, start + self.options.reserved_seq_ids)

    def session_history(self, session_id: str) -> tuple[int, ...]:
        """Token ids in the session's KV, in position order (empty if unknown)."""
        session = self._sessions.get(session_id)
        return () if session is None else tuple(session.history)

    def session_histories(self) -> list[tuple[int, ...]]:
        """The token ids of every lane's KV (what the lanes hold, for eviction estimates)."""
        return [tuple(session.history) for session in self._sessions.values()]

    def copy_session_to_slot(self, session_id: str, slot: int, num_tokens: int) -> None:
        """Make ``slot`` hold the session's first ``num_tokens`` cells (shared, not copied).

        Raises:
            InvalidIterationError: Unknown session, bad slot, or a count the session lacks.
        """
        session = self._require(session_id)
        self._check_slot(slot)
        if not 0 < num_tokens <= session.token_count:
            raise InvalidIterationError(
                f"copy_session_to_slot: {num_tokens} tokens requested, session {session_id}"
                f" holds {session.token_count}")
        L.llama_memory_seq_rm(self._mem, slot, -1, -1)
        L.llama_memory_seq_cp(self._mem, session.seq_id, slot, 0, num_tokens)

    def copy_slot_to_session(self, slot: int, session_id: str, tokens: Sequence[int]) -> None:
        """Replace the session's KV with the slot's first ``len(tokens)`` cells.

        ``tokens`` are the ids those cells hold; the caller vouches for them.

        Raises:
            InvalidIterationError: Unknown session or bad slot.
        """
        session = self._require(session_id)
        self._check_slot(slot)
        L.llama_memory_seq_rm(self._mem, session.seq_id, -1, -1)
        if tokens:
            L.llama_memory_seq_cp(self._mem, slot, session.seq_id, 0, len(tokens))
        self._set_history(session, tokens)

    def clear_slot(self, slot: int) -> None:
        """Drop the slot's hold on its cells (cells no one else holds are freed)."""
        self._check_slot(slot)
        L.llama_memory_seq_rm(self._mem, slot, -1, -1)

    def save_slot_state(self, slot: int) -> HostState:
        """Serialize the slot's KV (``llama_state_seq_get_data_ext``) into host memory.

        Raises:
            DecodeFailedError: llama.cpp wrote fewer bytes than it announced.
        """
        self._check_slot(slot)
        size = int(L.llama_state_seq_get_size_ext(self._ctx, slot, _STATE_FLAGS))
        state = HostState(size)
        written = int(L.llama_state_seq_get_data_ext(self._ctx, state.as_ctypes(), size, slot,
                                                     _STATE_FLAGS))
        if written != size:
            state.release()
            raise DecodeFailedError(f"saving slot {slot}: wrote {written} of {size} bytes")
        return state

    def slot_state_bytes(self, slot: int) -> int:
        """Size of the slot's saved state, without saving it."""
        self._check_slot(slot)
        return int(L.llama_state_seq_get_size_ext(self._ctx, slot, _STATE_FLAGS))

    def load_session_state(self, session_id: str, state: HostState,
                           tokens: Sequence[int]) -> bool:
        """Replace the session's KV with a saved state holding ``tokens``.

        Returns:
            False when llama.cpp found no room for it; the session is then empty.

        Raises:
            InvalidIterationError: Unknown session.
        """
        session = self._require(session_id)
        L.llama_memory_seq_rm(self._mem, session.seq_id, -1, -1)
        read = int(L.llama_state_seq_set_data_ext(self._ctx, state.as_ctypes(), len(state),
                                                  session.seq_id, _STATE_FLAGS))
        if read == 0:
            L.llama_memory_seq_rm(self._mem, session.seq_id, -1, -1)
            self._set_history(session, ())
            return False
        self._set_history(session, tokens)
        return True

    def _check_slot(self, slot: int) -> None:
        if slot not in self.cache_slot_ids:
            raise InvalidIterationError(
                f"sequence id {slot} is not a prefix-cache slot ({self.cache_slot_ids})")

    def _set_history(self, session, tokens: Sequence[int]) -> None:
        session.token_count = len(tokens)
        session.history = list(tokens)
        self._reset_sampler(session)
