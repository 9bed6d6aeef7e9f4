"""The prefix cache's lane operations on :class:`~skippyd.engine.runtime.llama.LlamaRuntime`.

Every lane has a KV stream of its own and keeps its KV after its session ends, until the
lane is given to another session. These methods let the prefix cache use that kept KV;
which prefix goes where is the cache's business, not the runtime's. Only the worker
thread may call them.

* A new session may start in a lane with a leading part of what it holds
  (``ensure_session_active(lane=..., keep_tokens=...)``): a hit costs nothing.
* :meth:`LaneCacheMixin.copy_lane_prefix` copies another lane's KV into a session's
  lane through a saved state (below), then trims the rest. Not ``llama_memory_seq_cp``:
  between streams it copies the whole stream, and only at the start of the next
  ``llama_decode``, so a state saved or loaded in between would see stale cells.
* ``llama_state_seq_get_data_ext`` / ``set_data_ext`` save a lane's KV to host memory
  and load it into a session's lane.

A saved state lives in an anonymous memory mapping of its own (:class:`HostState`), not on
the malloc heap: states of every size come and go as the host tier churns, and on the
heap they fragmented it, so a long-running daemon's memory crept up although the tier
stayed within its budget. A dropped state's mapping goes back to the system, unless
:class:`StateMappings` keeps it for the next save of about its size (a few, bounded).
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

#: mmap flags of a fresh state mapping: its pages are faulted in by one call (Linux).
_FRESH_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class StateMappings:
    """Where saved states get their memory: a mapping a dropped state left, or a new one.

    Saving into a fresh anonymous mapping faults in every page as llama.cpp writes it,
    and that, not the copy, was most of a save: a 2.8 MB state (124 SmolLM2 tokens) took
    2.4 ms on a 2-core VM, 1.0 ms with the pages faulted in by ``MAP_POPULATE``, and a
    copy into pages already touched 0.1 ms. A save runs on the worker thread between
    steps, so every running stream waits for it. Under a stream of unique prompts every
    reused lane saves a state while the host tier drops another of about the same size:
    kept for the next save, that mapping makes the save nearly free.

    A released mapping is kept when it fits ``max_bytes`` beside the others kept (at
    most ``max_count`` of them, the oldest unmapped first); a state of ``size`` bytes
    takes the smallest kept mapping of ``size`` to ``size * 9 / 8`` bytes. The kept
    mappings are the only state memory outside the host tier's budget. Worker thread
    only.
    """

    def __init__(self, max_count: int = 4, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._kept: list[mmap.mmap] = []
        self.reused = 0
        """Saves that took a kept mapping (for tests and diagnostics)."""

    @property
    def kept_bytes(self) -> int:
        return sum(len(mapping) for mapping in self._kept)

    def take(self, size: int) -> mmap.mmap:
        """A mapping of at least ``size`` bytes (``size`` >= 1)."""
        fits = [m for m in self._kept if size <= len(m) <= size + size // 8]
        if fits:
            mapping = min(fits, key=len)
            self._kept.remove(mapping)
            self.reused += 1
            return mapping
        return mmap.mmap(-1, size, flags=_FRESH_MAP_FLAGS)

    def give(self, mapping: mmap.mmap) -> None:
        """Keep a released state's mapping, or unmap it when it does not fit the bounds."""
        if len(mapping) > self.max_bytes or self.max_count < 1:
            mapping.close()
            return
        self._kept.append(mapping)
        while len(self._kept) > self.max_count or self.kept_bytes > self.max_bytes:
            self._kept.pop(0).close()

    def clear(self) -> None:
        """Unmap every kept mapping."""
        while self._kept:
            self._kept.pop().close()


class HostState:
    """A saved sequence state in an anonymous mapping; ``len()`` is its size in bytes.

    The mapping is unmapped when the object is collected; :meth:`release` unmaps it at
    once, or hands it back to the :class:`StateMappings` it came from.
    """

    __slots__ = ("_map", "_mappings", "size")

    def __init__(self, size: int, mappings: StateMappings | None = None) -> None:
        self.size = size
        self._mappings = mappings
        self._map: mmap.mmap | None = (mmap.mmap(-1, max(size, 1)) if mappings is None
                                       else mappings.take(max(size, 1)))

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Host RAM the mapping takes: its length rounded up to whole pages (a reused
        mapping may be a little longer than the state)."""
        if self._map is None:
            return 0
        return -(-len(self._map) // mmap.PAGESIZE) * mmap.PAGESIZE

    def as_ctypes(self) -> ctypes.Array:
        """The state's bytes as a ctypes array over the mapping (no copy).

        Raises:
            ValueError: The state was released.
        """
        if self._map is None:
            raise ValueError("the state was released")
        return (ctypes.c_uint8 * self.size).from_buffer(self._map)

    def release(self) -> None:
        """Unmap now, or hand the mapping back to its :class:`StateMappings`.
        Idempotent; a released state reads as empty."""
        mapping, self._map, self.size = self._map, None, 0
        if mapping is None:
            return
        if self._mappings is None:
            mapping.close()
        else:
            self._mappings.give(mapping)


class LaneCacheMixin:
    """Lane operations; mixed into ``LlamaRuntime`` (uses its context and lanes, and
    its ``state_mappings``)."""

    state_mappings: StateMappings

    def session_history(self, session_id: str) -> tuple[int, ...]:
        """Token ids in the session's KV, in position order (empty if unknown)."""
        lane = self._sessions.get(session_id)
        return () if lane is None else tuple(lane.history)

    def lane_history(self, lane: int) -> tuple[int, ...]:
        """Token ids a lane's KV holds (its session's, or kept after it ended)."""
        return tuple(self._lane(lane).history)

    def lane_of(self, session_id: str) -> int | None:
        """The lane an active session is bound to."""
        lane = self._sessions.get(session_id)
        return None if lane is None else lane.seq_id

    def idle_lanes(self) -> list[int]:
        """Lanes no session is bound to, lowest first."""
        return [lane.seq_id for lane in self._lanes if lane.session_id is None]

    def copy_lane_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        """Make the session hold the first ``num_tokens`` tokens of lane ``source``.

        The session's lane must hold nothing the session needs: it is replaced. From its
        own lane this only trims; from another lane the lane's KV is copied.

        Raises:
            InvalidIterationError: Unknown session or lane, or a count the lane lacks.
            DecodeFailedError: llama.cpp could not copy the state.
        """
        target = self._require(session_id)
        origin = self._lane(source)
        if not 0 < num_tokens <= origin.token_count:
            raise InvalidIterationError(
                f"copy_lane_prefix: {num_tokens} tokens requested, lane {source} holds"
                f" {origin.token_count}")
        tokens = origin.history[:num_tokens]
        if origin is not target:
            state = self.save_lane_state(source)
            try:
                if not self.load_session_state(session_id, state, origin.history):
                    raise DecodeFailedError(f"copying lane {source} into session {session_id}:"
                                            " llama.cpp could not load the state")
            finally:
                state.release()
        L.llama_memory_seq_rm(self._mem, target.seq_id, num_tokens, -1)
        self._set_history(target, tokens)

    def clear_lane(self, lane: int) -> None:
        """Forget what an idle lane kept."""
        idle = self._idle_lane(lane)
        L.llama_memory_seq_rm(self._mem, idle.seq_id, -1, -1)
        self._set_history(idle, ())

    def save_lane_state(self, lane: int, size: int | None = None) -> HostState:
        """Serialize a lane's KV (``llama_state_seq_get_data_ext``) into host memory.

        Args:
            lane: The lane to save.
            size: Its :meth:`lane_state_bytes`, when the caller has just read it and the
                lane has not changed since (llama.cpp walks the whole state to size it).

        Raises:
            DecodeFailedError: llama.cpp wrote fewer bytes than it announced.
        """
        seq_id = self._lane(lane).seq_id
        if size is None:
            size = self.lane_state_bytes(lane)
        state = HostState(size, self.state_mappings)
        written = int(L.llama_state_seq_get_data_ext(self._ctx, state.as_ctypes(), size,
                                                     seq_id, _STATE_FLAGS))
        if written != size:
            state.release()
            raise DecodeFailedError(f"saving lane {lane}: wrote {written} of {size} bytes")
        return state

    def lane_state_bytes(self, lane: int) -> int:
        """Size of a lane's saved state, without saving it."""
        return int(L.llama_state_seq_get_size_ext(self._ctx, self._lane(lane).seq_id,
                                                  _STATE_FLAGS))

    def load_session_state(self, session_id: str, state: HostState,
                           tokens: Sequence[int]) -> bool:
        """Replace the session's KV with a saved state holding ``tokens``.

        Returns:
            False when llama.cpp could not load it; the session is then empty.

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

    def _lane(self, lane: int):
        if not 0 <= lane < len(self._lanes):
            raise InvalidIterationError(f"no lane {lane} (lanes 0..{len(self._lanes) - 1})")
        return self._lanes[lane]

    def _set_history(self, lane, tokens: Sequence[int]) -> None:
        lane.token_count = len(tokens)
        lane.history = list(tokens)
        self._reset_sampler(lane)
