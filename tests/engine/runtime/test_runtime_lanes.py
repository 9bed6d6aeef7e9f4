"""Lanes of the real runtime (tiny model): one KV stream each, kept after a session ends,
reused in place, copied, saved to host RAM and loaded.

Continuations are compared bit for bit with a fresh runtime fed the same batch shapes
(batch shapes change llama.cpp's arithmetic; what shares a batch must not).
"""

from __future__ import annotations

import mmap

import pytest
from cache_helpers import GREEDY, greedy_continue, open_runtime, prefill, tokens
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationRequest,
    LanesBusyError,
    RowPhase,
)
from skippyd.engine.runtime.host_state import HostState, StateMappings

PREFIX = tokens(1, 96)
SUFFIX = tokens(2, 12)


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> list[int]:
    """Greedy tokens of PREFIX (one call) then SUFFIX (one call), without any cache."""
    with open_runtime(tiny_model_path) as fresh:
        prefill(fresh, "ref", PREFIX)
        return greedy_continue(fresh, "ref", SUFFIX, 8)


def test_the_pool_is_split_into_one_stream_per_lane(runtime):
    assert runtime.kv_pool_tokens == 2048
    assert runtime.max_session_tokens == runtime.lane_capacity_tokens == 512


def test_new_sessions_take_the_lowest_idle_lane_holding_nothing(runtime):
    for name in ("a", "b", "c"):
        runtime.ensure_session_active(name)
    assert [runtime.lane_of(name) for name in ("a", "b", "c")] == [0, 1, 2]
    prefill(runtime, "b", PREFIX[:20])
    runtime.drop_session("b")  # lane 1 keeps its KV
    runtime.ensure_session_active("d")
    assert runtime.lane_of("d") == 3  # an empty lane before one that holds something
    runtime.ensure_session_active("e")
    assert runtime.lane_of("e") == 1  # then the lowest idle lane, cleared
    assert runtime.session_token_count("e") == 0
    with pytest.raises(LanesBusyError):
        runtime.ensure_session_active("f")


def test_a_new_session_in_a_call_takes_the_lane_it_asks_for_when_idle(runtime):
    runtime.ensure_session_active("held")  # lane 0
    runtime.run_iteration([
        IterationRequest("free", tokens(4, 3), lane=2),
        IterationRequest("plain", tokens(5, 3)),  # takes what the asked-for lanes leave
        IterationRequest("taken", tokens(6, 3), lane=0),  # lane 0 is bound: any lane
    ])
    assert [runtime.lane_of(s) for s in ("held", "free", "plain", "taken")] == [0, 2, 1, 3]
    runtime.run_iteration([IterationRequest("free", tokens(7, 1), lane=3)])
    assert runtime.lane_of("free") == 2  # a bound session stays where it is


def test_a_lane_keeps_its_kv_and_a_new_session_continues_it_in_place(runtime, expected):
    prefill(runtime, "source", PREFIX + tokens(3, 40))  # the source went on past the prefix
    lane = runtime.lane_of("source")
    runtime.drop_session("source")
    assert runtime.idle_lanes() == [0, 1, 2, 3]
    assert runtime.lane_history(lane)[:len(PREFIX)] == tuple(PREFIX)
    runtime.ensure_session_active("hit", lane=lane, keep_tokens=len(PREFIX))
    assert runtime.session_history("hit") == tuple(PREFIX)
    assert greedy_continue(runtime, "hit", SUFFIX, 8) == expected


def test_a_prefix_copied_from_another_lane_continues_exactly(runtime, tiny_model_path):
    prefill(runtime, "source", PREFIX)  # stays active: copies come from busy lanes too
    runtime.ensure_session_active("hit")
    runtime.copy_lane_prefix(runtime.lane_of("source"), "hit", 64)
    assert runtime.session_history("hit") == tuple(PREFIX[:64])
    with open_runtime(tiny_model_path) as fresh:
        prefill(fresh, "ref", PREFIX[:64])
        reference = greedy_continue(fresh, "ref", SUFFIX, 6)
    assert greedy_continue(runtime, "hit", SUFFIX, 6) == reference
    assert runtime.session_history("source") == tuple(PREFIX)  # the source is untouched


def test_a_saved_lane_loads_into_another_lane_and_continues_exactly(runtime, expected):
    prefill(runtime, "source", PREFIX)
    lane = runtime.lane_of("source")
    runtime.drop_session("source")
    state = runtime.save_lane_state(lane)
    assert len(state) == runtime.lane_state_bytes(lane) > 0
    assert isinstance(state, HostState)  # its own mapping, off the malloc heap
    runtime.clear_lane(lane)
    mem = L.llama_get_memory(runtime.context)
    assert L.llama_memory_seq_pos_max(mem, lane) == -1  # the lane holds nothing now
    runtime.ensure_session_active("host-hit", lane=(lane + 1) % 4)
    assert runtime.load_session_state("host-hit", state, PREFIX)
    assert runtime.session_token_count("host-hit") == len(PREFIX)
    assert greedy_continue(runtime, "host-hit", SUFFIX, 8) == expected


def test_rows_of_any_order_give_each_session_its_own_continuation(runtime, tiny_model_path):
    # Rows are written in lane order, whatever order the requests come in: each session
    # must still get its own sample, the same as alone in the same batch shape.
    prompts = {f"s{i}": tokens(10 + i, 8 + i) for i in range(4)}
    for name in ("s2", "s0", "s3", "s1"):
        runtime.ensure_session_active(name)  # lanes 0..3 in a shuffled order
    order = ["s1", "s3", "s0", "s2"]
    out = runtime.run_iteration(
        [IterationRequest(n, prompts[n], sampling=GREEDY, sample_last=True) for n in order])
    got = {order[s.request_index]: s.token for s in out.samples}
    with open_runtime(tiny_model_path) as fresh:
        for name in ("s2", "s0", "s3", "s1"):
            fresh.ensure_session_active(name)
        lane_order = sorted(order, key=fresh.lane_of)
        ref = fresh.run_iteration(
            [IterationRequest(n, prompts[n], sampling=GREEDY, sample_last=True)
             for n in lane_order])
        want = {lane_order[s.request_index]: s.token for s in ref.samples}
    assert got == want
    step = runtime.run_iteration(
        [IterationRequest(n, [got[n]], sampling=GREEDY, sample_last=True,
                          phase=RowPhase.DECODE) for n in order])
    assert len(step.samples) == 4


def test_lane_operations_refuse_bad_lanes_and_counts(runtime):
    prefill(runtime, "source", PREFIX[:10])
    lane = runtime.lane_of("source")
    runtime.ensure_session_active("other")
    with pytest.raises(InvalidIterationError, match="not an idle lane"):
        runtime.ensure_session_active("third", lane=lane)  # busy
    with pytest.raises(InvalidIterationError, match="holds 10"):
        runtime.copy_lane_prefix(lane, "other", 11)
    with pytest.raises(InvalidIterationError, match="no lane 9"):
        runtime.copy_lane_prefix(9, "other", 1)
    with pytest.raises(InvalidIterationError, match="unknown session"):
        runtime.copy_lane_prefix(lane, "nobody", 1)
    runtime.drop_session("source")
    with pytest.raises(InvalidIterationError, match="cannot keep 11"):
        runtime.ensure_session_active("third", lane=lane, keep_tokens=11)
    assert runtime.lane_history(lane) == tuple(PREFIX[:10])  # nothing changed


def test_a_session_cannot_grow_beyond_its_lane(runtime):
    limit = runtime.max_session_tokens
    prefill(runtime, "long", tokens(4, limit // 2))
    prefill(runtime, "long", tokens(5, limit // 2))  # the lane is full
    with pytest.raises(InvalidIterationError, match="beyond its lane"):
        runtime.run_iteration([IterationRequest("long", [7], sample_last=True)])
    assert runtime.session_token_count("long") == limit  # nothing changed


def test_a_host_state_is_its_own_mapping_and_can_be_released_early():
    state = HostState(10)
    state.as_ctypes()[:] = range(10)
    assert len(state) == 10 and bytes(state.as_ctypes()) == bytes(range(10))
    assert state.nbytes == mmap.PAGESIZE  # what the host budget counts: whole pages
    state.release()
    state.release()  # idempotent
    assert len(state) == 0


def test_a_released_state_leaves_its_mapping_for_the_next_state_of_about_its_size():
    mappings = StateMappings(max_count=2, max_bytes=1 << 20)
    first = HostState(80_000, mappings)
    first.as_ctypes()[:4] = [1, 2, 3, 4]
    first.release()
    assert len(first) == 0 and first.nbytes == 0 and mappings.kept_bytes == 80_000
    with pytest.raises(ValueError, match="released"):
        first.as_ctypes()
    second = HostState(75_000, mappings)  # within 1/8 of the kept mapping: reused
    assert mappings.reused == 1 and mappings.kept_bytes == 0
    assert len(second) == 75_000 and len(second.as_ctypes()) == 75_000
    assert second.nbytes == -(-80_000 // mmap.PAGESIZE) * mmap.PAGESIZE  # all it holds
    second.release()
    HostState(60_000, mappings).release()  # more than 1/8 smaller: a fresh mapping
    assert mappings.reused == 1 and mappings.kept_bytes == 80_000 + 60_000


def test_kept_mappings_stay_within_their_count_and_bytes_oldest_out_first():
    mappings = StateMappings(max_count=2, max_bytes=100_000)
    for size in (30_000, 40_000, 50_000):
        HostState(size, mappings).release()
    assert mappings.kept_bytes == 40_000 + 50_000  # the oldest went: at most 2 kept
    HostState(60_000, mappings).release()
    assert mappings.kept_bytes == 60_000  # 50_000 + 60_000 is over the bytes bound
    HostState(200_000, mappings).release()  # larger than the bound: never kept
    assert mappings.kept_bytes == 60_000
    mappings.clear()
    assert mappings.kept_bytes == 0


def test_a_state_saved_into_a_reused_mapping_loads_and_continues_exactly(runtime, expected):
    prefill(runtime, "source", PREFIX)
    lane = runtime.lane_of("source")
    runtime.drop_session("source")
    runtime.save_lane_state(lane).release()  # its mapping is kept for the next save
    reused_before = runtime.state_mappings.reused
    state = runtime.save_lane_state(lane)
    assert runtime.state_mappings.reused == reused_before + 1
    runtime.clear_lane(lane)
    runtime.ensure_session_active("host-hit", lane=(lane + 1) % 4)
    assert runtime.load_session_state("host-hit", state, PREFIX)
    assert greedy_continue(runtime, "host-hit", SUFFIX, 8) == expected
