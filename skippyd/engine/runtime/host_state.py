"""Saved lane states in host memory: what the prefix cache's host tier keeps.

``llama_state_seq_get_data_ext`` / ``set_data_ext`` save a lane's KV to host memory and
load it into a session's lane (:class:`HostStates`).

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

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.contract import DecodeFailedError

logger = logging.getLogger(__name__)

#: ``llama_state_seq_*_ext`` flags: 0 saves every layer's KV of the lane.
_STATE_FLAGS = 0

#: mmap flags of a fresh state mapping: its pages are faulted in by one call (Linux).
_FRESH_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class StateMappings:
    """Where saved states get their memory: a mapping a dropped state left, or a new one.

    Saving into a fresh anonymous mapping faults in every page as llama.cpp writes it,
    and that, not the copy, is most of a save (``docs/performance-notes.md`` has the
    figures). A save runs on the worker thread between
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
    """A lane's saved KV state in an anonymous mapping; ``len()`` is its size in bytes.

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


class HostStates:
    """Saves and loads the KV states of one llama.cpp context's lanes; worker thread only.

    Args:
        ctx: The context.
        mappings: Where states get their memory.
    """

    def __init__(self, ctx, mappings: StateMappings | None = None) -> None:
        self._ctx = ctx
        self.mappings = StateMappings() if mappings is None else mappings

    def size_of(self, seq_id: int) -> int:
        """Bytes a save of lane ``seq_id`` takes, without saving it."""
        return int(L.llama_state_seq_get_size_ext(self._ctx, seq_id, _STATE_FLAGS))

    def save(self, seq_id: int, size: int | None = None) -> HostState:
        """Serialize lane ``seq_id``'s KV into host memory.

        Args:
            seq_id: The lane.
            size: Its :meth:`size_of`, when the caller has just read it and the lane
                has not changed since (llama.cpp walks the whole state to size it).

        Raises:
            DecodeFailedError: llama.cpp wrote fewer bytes than it announced.
        """
        if size is None:
            size = self.size_of(seq_id)
        state = HostState(size, self.mappings)
        written = int(L.llama_state_seq_get_data_ext(self._ctx, state.as_ctypes(), size,
                                                     seq_id, _STATE_FLAGS))
        if written != size:
            state.release()
            raise DecodeFailedError(f"saving lane {seq_id}: wrote {written} of {size} bytes")
        return state

    def load(self, seq_id: int, state: HostState) -> bool:
        """Load ``state`` into lane ``seq_id`` (which the caller emptied first).

        Returns:
            False when llama.cpp could not load it.
        """
        return int(L.llama_state_seq_set_data_ext(self._ctx, state.as_ctypes(), len(state),
                                                  seq_id, _STATE_FLAGS)) != 0

    def close(self) -> None:
        self.mappings.clear()
