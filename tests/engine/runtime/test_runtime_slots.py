"""Prefix-cache slots of the real runtime (tiny model): copy, restore, save, load, clear.

Continuations are compared bit for bit with a fresh runtime fed the same batch shapes
(DESIGN.md item 8: shapes change the arithmetic, isolation does not).
"""

from __future__ import annotations

import mmap

import pytest
from cache_helpers import greedy_continue, open_runtime, prefill, tokens
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.cache_slots import HostState
from skippyd.engine.runtime.protocol import InvalidIterationError

PREFIX = tokens(1, 96)
SUFFIX = tokens(2, 12)


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> list[int]:
    """Greedy tokens of PREFIX (one call) then SUFFIX (one call), without any cache."""
    with open_runtime(tiny_model_path, slots=0) as fresh:
        prefill(fresh, "ref", PREFIX)
        return greedy_continue(fresh, "ref", SUFFIX, 8)


def test_slots_are_the_sequence_ids_after_the_lanes(runtime):
    assert runtime.cache_slot_ids == range(4, 12)


def test_a_prefix_copied_to_a_slot_outlives_its_lane_and_continues_exactly(runtime, expected):
    prefill(runtime, "source", PREFIX + tokens(3, 40))  # the source went on past the prefix
    runtime.copy_session_to_slot("source", 4, len(PREFIX))
    runtime.drop_session("source")
    runtime.ensure_session_active("hit")
    runtime.copy_slot_to_session(4, "hit", PREFIX)
    assert runtime.session_token_count("hit") == len(PREFIX)
    assert runtime.session_history("hit") == tuple(PREFIX)
    assert greedy_continue(runtime, "hit", SUFFIX, 8) == expected


def test_a_partial_copy_restores_a_shorter_prefix(runtime, tiny_model_path):
    prefill(runtime, "source", PREFIX)
    runtime.copy_session_to_slot("source", 5, len(PREFIX))
    runtime.ensure_session_active("hit")
    runtime.copy_slot_to_session(5, "hit", PREFIX[:64])
    with open_runtime(tiny_model_path, slots=0) as fresh:
        prefill(fresh, "ref", PREFIX[:64])
        reference = greedy_continue(fresh, "ref", SUFFIX, 6)
    assert greedy_continue(runtime, "hit", SUFFIX, 6) == reference


def test_a_saved_state_loads_into_another_lane_and_continues_exactly(runtime, expected):
    prefill(runtime, "source", PREFIX)
    runtime.copy_session_to_slot("source", 6, len(PREFIX))
    runtime.drop_session("source")
    state = runtime.save_slot_state(6)
    assert len(state) == runtime.slot_state_bytes(6) > 0
    assert isinstance(state, HostState)  # its own mapping, off the malloc heap
    runtime.clear_slot(6)
    mem = L.llama_get_memory(runtime.context)
    assert L.llama_memory_seq_pos_max(mem, 6) == -1  # the slot holds nothing now
    runtime.ensure_session_active("host-hit")
    assert runtime.load_session_state("host-hit", state, PREFIX)
    assert runtime.session_token_count("host-hit") == len(PREFIX)
    assert greedy_continue(runtime, "host-hit", SUFFIX, 8) == expected


def test_slot_operations_refuse_bad_ids_and_counts(runtime):
    prefill(runtime, "source", PREFIX[:10])
    with pytest.raises(InvalidIterationError, match="not a prefix-cache slot"):
        runtime.copy_session_to_slot("source", 0, 5)  # a lane, not a slot
    with pytest.raises(InvalidIterationError, match="holds 10"):
        runtime.copy_session_to_slot("source", 4, 11)
    with pytest.raises(InvalidIterationError, match="unknown session"):
        runtime.copy_slot_to_session(4, "nobody", [1])
    assert runtime.session_token_count("source") == 10  # nothing changed


def test_a_host_state_is_its_own_mapping_and_can_be_released_early():
    state = HostState(10)
    state.as_ctypes()[:] = range(10)
    assert len(state) == 10 and bytes(state.as_ctypes()) == bytes(range(10))
    assert state.nbytes == mmap.PAGESIZE  # what the host budget counts: whole pages
    state.release()
    state.release()  # idempotent
    assert len(state) == 0
