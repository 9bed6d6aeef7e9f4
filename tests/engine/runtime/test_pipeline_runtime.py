"""PipelineRuntime's own rules, over a real (tiny) local slice and a scripted chain.

The scripted downstream records every batch and lets the test answer them from another
thread, the way the link's reader thread does: decode groups, prefill chunks that do
not wait, look-ahead steps (used, or retracted from the local KV), and a lost chain.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.pipeline import PipelineRuntime
from skippyd.engine.runtime.pipeline_types import ChainSample, ChainUnavailableError

GREEDY = SamplingConfig(temperature=0.0)
TIMEOUT_S = 10


class ScriptedChain:
    """A Downstream that records batches; the test answers them."""

    def __init__(self) -> None:
        self.epoch = 1
        self.is_up = True
        self.num_stages = 1
        self.batches: list[tuple[int, list]] = []
        self.drops: list[int] = []
        self.resets: list[str] = []
        self.runtime: PipelineRuntime | None = None
        self._sent = threading.Condition()

    def down_reason(self) -> str | None:
        return None if self.is_up else "scripted outage"

    def send_batch(self, request_id, entries) -> None:
        if not self.is_up:
            raise ChainUnavailableError("scripted outage")
        with self._sent:
            self.batches.append((request_id, list(entries)))
            self._sent.notify_all()

    def send_drop(self, session_id: int) -> None:
        self.drops.append(session_id)

    def reset(self, epoch: int, reason: str) -> None:
        self.resets.append(reason)

    def wait_batches(self, count: int) -> list[tuple[int, list]]:
        with self._sent:
            assert self._sent.wait_for(lambda: len(self.batches) >= count, TIMEOUT_S), (
                f"expected {count} batches, got {len(self.batches)}")
            return list(self.batches)

    def answer(self, batch_index: int, tokens: dict[int, int]) -> None:
        """RESULT for a recorded batch: ``tokens`` maps entry index to the prediction."""
        request_id, _ = self.batches[batch_index]
        self.runtime.on_result(self.epoch, request_id,
                               [ChainSample(i, t, False) for i, t in tokens.items()])

    def lose(self) -> None:
        self.is_up = False
        self.runtime.on_down(self.epoch, "scripted outage")


@contextmanager
def scripted_chain(model_path, decode_groups: int | None, step_ms=None):
    local = LlamaRuntime(RuntimeOptions(str(model_path), lane_count=4, ctx_size=256,
                                        n_batch=128, n_ubatch=32, threads=1,
                                        final_stage=False))
    scripted = ScriptedChain()
    scripted.runtime = PipelineRuntime(local, scripted, decode_groups=decode_groups,
                                       step_ms=step_ms, reply_timeout_s=5)
    try:
        with ThreadPoolExecutor(1) as worker:  # the one thread that calls the runtime
            scripted.worker = worker
            yield scripted
    finally:
        local.close()


@pytest.fixture
def chain(tiny_model_path):
    with scripted_chain(tiny_model_path, decode_groups=2) as scripted:
        yield scripted


def _run(chain, requests) -> Future:
    return chain.worker.submit(chain.runtime.run_iteration, requests)


def _decode(session: str, token: int, position: int) -> IterationRequest:
    return IterationRequest(session, [token], positions=[position], sampling=GREEDY,
                            sample_last=True, phase=RowPhase.DECODE)


def test_groups_lookahead_and_reuse(chain):
    prompts = [IterationRequest("a", [5, 6, 7], positions=[0, 1, 2], sampling=GREEDY,
                                sample_last=True),
               IterationRequest("b", [8, 9], positions=[0, 1], sampling=GREEDY,
                                sample_last=True)]
    call = _run(chain, prompts)
    batches = chain.wait_batches(2)  # two decode groups: one batch per session
    assert [[e.session_id for e in entries] for _, entries in batches] == [[1], [2]]
    assert batches[0][1][0].rows.shape == (3, 64) and batches[0][1][0].sample_last
    chain.answer(0, {0: 40})
    # "a" answered while "b" is still out: its next step is computed and shipped at once.
    lookahead = chain.wait_batches(3)[2][1][0]
    assert (lookahead.session_id, lookahead.first_position, lookahead.token_ids) == (1, 3, [40])
    chain.answer(1, {0: 41})
    output = call.result(TIMEOUT_S)
    assert [(s.request_index, s.token) for s in output.samples] == [(0, 40), (1, 41)]
    assert chain.runtime.session_token_count("a") == 3  # the look-ahead token is not counted
    assert chain.runtime.local.session_token_count("a") == 4

    call = _run(chain, [_decode("a", 40, 3)])  # matches the look-ahead step: nothing new
    chain.answer(2, {0: 50})
    assert [s.token for s in call.result(TIMEOUT_S).samples] == [50]
    assert len(chain.batches) == 3 and chain.runtime.counters.lookahead_hits == 1


def test_decode_rows_are_grouped_in_lane_order_and_carry_their_lanes(chain):
    # llama.cpp splits a batch at every gap between lanes: groups of lanes 0-1 and 2-3
    # run as one evaluation each on every stage, whatever order the scheduler gave.
    for name, lane in zip("abcd", (2, 0, 3, 1), strict=True):
        chain.runtime.ensure_session_active(name, lane)
    call = _run(chain, [IterationRequest(name, [5 + i], positions=[0], sampling=GREEDY,
                                         sample_last=True, phase=RowPhase.DECODE)
                        for i, name in enumerate("abcd")])
    batches = chain.wait_batches(2)
    assert [[e.lane for e in entries] for _, entries in batches] == [[0, 1], [2, 3]]
    chain.answer(0, {0: 40, 1: 41})
    chain.answer(1, {0: 42, 1: 43})
    output = call.result(TIMEOUT_S)
    # Samples keep the caller's order: "a" (lane 2) got the first entry of batch 1.
    assert [(s.request_index, s.token) for s in output.samples] == [
        (0, 42), (1, 40), (2, 43), (3, 41)]


# Step costs under which a full stage of 4 lanes decodes in batches of 2: lane blocks
# {0, 1} and {2, 3}.
BLOCKS_OF_TWO = (20.0, 36.0, 52.0, 54.0)


def _bind(chain, lanes: dict[str, int]) -> None:
    for name, lane in lanes.items():
        chain.runtime.ensure_session_active(name, lane)


def test_decode_batches_follow_lane_blocks_not_the_rows_at_hand(tiny_model_path):
    # Three rows cut by their costs alone would go as [lane 0] and [lanes 1, 3]: a
    # batch with a gap, which llama.cpp runs as two evaluations, on every step to come.
    with scripted_chain(tiny_model_path, decode_groups=None, step_ms=BLOCKS_OF_TWO) as chain:
        assert chain.runtime.block_lanes == 2
        _bind(chain, {"a": 3, "b": 0, "c": 1})
        call = _run(chain, [_decode("a", 5, 0), _decode("b", 6, 0), _decode("c", 7, 0)])
        batches = chain.wait_batches(2)
        assert [[e.lane for e in entries] for _, entries in batches] == [[0, 1], [3]]
        chain.answer(0, {0: 40, 1: 41})
        chain.answer(1, {0: 42})
        assert [s.token for s in call.result(TIMEOUT_S).samples] == [42, 40, 41]


def test_a_block_split_over_two_batches_travels_on_as_one(tiny_model_path):
    with scripted_chain(tiny_model_path, decode_groups=None, step_ms=BLOCKS_OF_TWO) as chain:
        _bind(chain, {"a": 0, "b": 1, "c": 2})
        call = _run(chain, [_decode("a", 5, 0), _decode("c", 6, 0)])
        chain.wait_batches(2)
        chain.answer(0, {0: 40})
        assert chain.wait_batches(3)[2][1][0].token_ids == [40]  # a's look-ahead
        chain.answer(1, {0: 41})
        call.result(TIMEOUT_S)
        # "b" joins block {0, 1} while a's look-ahead step is out: it goes alone now ...
        call = _run(chain, [_decode("a", 40, 1), _decode("b", 7, 0), _decode("c", 41, 1)])
        batches = chain.wait_batches(5)
        assert [[e.lane for e in entries] for _, entries in batches[3:]] == [[1], [2]]
        step_a = chain.runtime._batches[batches[2][0]].steps[0]
        chain.answer(2, {0: 50})
        deadline = time.monotonic() + TIMEOUT_S
        while not step_a.followed:  # taken in, and held for "b"
            assert time.monotonic() < deadline, "the prediction was never taken in"
            time.sleep(0.001)
        assert len(chain.batches) == 5
        # ... and once its prediction is back the block goes on as one batch.
        chain.answer(3, {0: 51})
        merged = chain.wait_batches(6)[5][1]
        assert [(e.lane, e.token_ids) for e in merged] == [(0, [50]), (1, [51])]
        chain.answer(4, {0: 52})
        assert [s.token for s in call.result(TIMEOUT_S).samples] == [50, 51, 52]


def test_a_new_session_takes_the_lowest_idle_lane_even_one_that_held_kv(chain):
    # No prefix cache on a split stage: old KV is worth nothing, whole lane blocks are.
    _run(chain, [IterationRequest("a", [5, 6], positions=[0, 1])]).result(TIMEOUT_S)
    assert chain.runtime.lane_of("a") == 0
    chain.worker.submit(chain.runtime.drop_session, "a").result(TIMEOUT_S)
    chain.worker.submit(chain.runtime.ensure_session_active, "b").result(TIMEOUT_S)
    assert chain.runtime.lane_of("b") == 0


def test_predictions_that_arrive_together_are_shipped_again_as_separate_groups(
        tiny_model_path):
    with scripted_chain(tiny_model_path, decode_groups=4) as chain:
        call = _run(chain, [IterationRequest(name, [5 + i], positions=[0], sampling=GREEDY,
                                             sample_last=True)
                            for i, name in enumerate("abcd")])
        assert len(chain.wait_batches(4)) == 4  # one session per group
        # Both answers land while stage 0 is busy (it holds the runtime's lock): the two
        # look-ahead steps still travel as two groups, not merged into one batch.
        with chain.runtime._cond:
            chain.answer(0, {0: 40})
            chain.answer(1, {0: 41})
        lookahead = chain.wait_batches(6)[4:]
        assert [[(e.session_id, e.token_ids) for e in entries] for _, entries in lookahead] == [
            [(1, [40])], [(2, [41])]]
        chain.answer(2, {0: 42})
        chain.answer(3, {0: 43})
        output = call.result(TIMEOUT_S)
        assert [s.token for s in output.samples] == [40, 41, 42, 43]


def _one_token_prompts(names: str) -> list[IterationRequest]:
    return [IterationRequest(name, [5 + i], positions=[0], sampling=GREEDY, sample_last=True)
            for i, name in enumerate(names)]


def test_timed_step_costs_size_the_decode_batches(tiny_model_path):
    # Equal groups (the configured way) cut 4 rows in 3; with step costs where a row
    # costs about as much as the step's fixed part, two batches of 2 cycle fastest.
    with scripted_chain(tiny_model_path, decode_groups=3) as chain:
        _run(chain, _one_token_prompts("abcd"))
        assert [len(entries) for _, entries in chain.wait_batches(3)] == [1, 2, 1]
        chain.lose()
    with scripted_chain(tiny_model_path, decode_groups=None,
                        step_ms=(20.0, 36.0, 52.0, 54.0)) as chain:
        assert chain.runtime.step_ms == (20.0, 36.0, 52.0, 54.0)
        call = _run(chain, _one_token_prompts("abcd"))
        assert [len(entries) for _, entries in chain.wait_batches(2)] == [2, 2]
        chain.answer(0, {0: 40, 1: 41})
        # Predictions that come back while the other batch is in flight go out again as
        # one batch of 2: a cycle of [2, 2], not [1, 1, 2].
        lookahead = chain.wait_batches(3)[2][1]
        assert [(e.session_id, e.token_ids) for e in lookahead] == [(1, [40]), (2, [41])]
        chain.answer(1, {0: 42, 1: 43})
        assert [s.token for s in call.result(TIMEOUT_S).samples] == [40, 41, 42, 43]


def test_a_prediction_that_comes_back_alone_waits_for_a_batch_of_the_calls_size(
        tiny_model_path):
    # Two rows in one step cost hardly more than one: three rows go as [1, 2], and
    # look-ahead steps go out two at a time.
    with scripted_chain(tiny_model_path, decode_groups=None,
                        step_ms=(30.0, 32.0, 60.0)) as chain:
        call = _run(chain, _one_token_prompts("abc"))
        batches = chain.wait_batches(2)
        assert [len(entries) for _, entries in batches] == [1, 2]
        step_a = chain.runtime._batches[batches[0][0]].steps[0]
        chain.answer(0, {0: 40})  # "a" alone: held, not shipped as a batch of one
        deadline = time.monotonic() + TIMEOUT_S
        while not step_a.followed:  # the worker has taken the prediction in
            assert time.monotonic() < deadline, "the prediction was never taken in"
            time.sleep(0.001)
        chain.answer(1, {0: 41, 1: 42})  # the rest: the call returns
        assert [s.token for s in call.result(TIMEOUT_S).samples] == [40, 41, 42]
        assert len(chain.batches) == 2 and chain.runtime.counters.lookahead_steps == 0
        # The held step is the next call's own, computed then.
        assert chain.runtime.session_token_count("a") == 1


def test_a_lookahead_the_scheduler_does_not_want_is_retracted(chain):
    call = _run(chain, [IterationRequest("a", [5, 6], positions=[0, 1], sampling=GREEDY,
                                         sample_last=True),
                        IterationRequest("b", [7], positions=[0], sampling=GREEDY,
                                         sample_last=True)])
    chain.wait_batches(2)
    chain.answer(0, {0: 40})
    chain.wait_batches(3)  # look-ahead for "a" at position 2
    chain.answer(1, {0: 41})
    call.result(TIMEOUT_S)
    # The scheduler replays "a" from position 1 instead (a different request).
    call = _run(chain, [IterationRequest("a", [6], positions=[1], sampling=GREEDY,
                                         sample_last=True)])
    replay = chain.wait_batches(4)[3][1][0]
    assert (replay.first_position, replay.token_ids) == (1, [6])
    chain.answer(3, {0: 44})
    assert [s.token for s in call.result(TIMEOUT_S).samples] == [44]
    assert chain.runtime.local.session_token_count("a") == 2
    assert chain.runtime.counters.lookahead_retracted == 1
    chain.answer(2, {0: 99})  # the stale look-ahead's late answer is ignored


def test_prefill_chunks_do_not_wait_and_drops_reach_the_chain(chain):
    output = _run(chain, [IterationRequest("p", list(range(3, 35)), positions=range(32))]
                  ).result(TIMEOUT_S)
    assert output.samples == []  # returned without an answer
    # The chunk travels in two parts (one per stage), so stage 1 starts on the first
    # while stage 0 computes the second.
    assert [(e.first_position, len(e.token_ids)) for _, [e] in chain.batches] == [(0, 16),
                                                                                 (16, 16)]
    assert chain.runtime.kv_cells_used() == 32  # stage 0's own cells, as the snapshot shows
    assert chain.runtime.lane_of("p") is not None
    chain.worker.submit(chain.runtime.drop_session, "p").result(TIMEOUT_S)
    assert chain.drops == [1] and chain.runtime.local.session_token_count("p") is None
    assert chain.runtime.kv_cells_used() == 0


def test_a_sampled_prompt_ends_in_a_small_batch(chain):
    # Stage 0 waits for the last stage to run a call's last batch: cut in halves, it
    # keeps that wait to a few rows' time instead of a whole group's.
    call = _run(chain, [IterationRequest("p", list(range(3, 43)), positions=range(40),
                                         sampling=GREEDY, sample_last=True)])
    batches = chain.wait_batches(3)
    assert [(e.first_position, len(e.token_ids), e.sample_last)
            for _, [e] in batches] == [(0, 20, False), (20, 10, False), (30, 10, True)]
    chain.answer(2, {0: 40})
    assert [s.token for s in call.result(TIMEOUT_S).samples] == [40]


def test_a_call_that_ends_in_a_chunk_sampling_nothing_is_not_tapered(chain):
    # The taper shortens the wait for a sampled end; here the sampled prompt comes first
    # and the call ends in another prompt's chunk, which nothing waits for: the sampled
    # prompt goes in the call's groups, the other chunk whole after them (it is shorter
    # than PREFILL_PIECE_TOKENS), and the call returns once the sample is back.
    call = _run(chain, [IterationRequest("p", list(range(3, 43)), positions=range(40),
                                         sampling=GREEDY, sample_last=True),
                        IterationRequest("q", list(range(3, 43)), positions=range(40))])
    batches = chain.wait_batches(3)
    assert [[(e.session_id, len(e.token_ids), e.sample_last) for e in entries]
            for _, entries in batches] == [[(1, 20, False)], [(1, 20, True)],
                                           [(2, 40, False)]]
    chain.answer(1, {0: 40})
    assert [s.token for s in call.result(TIMEOUT_S).samples] == [40]


def test_a_lost_chain_fails_waiting_and_later_calls(chain):
    call = _run(chain, [_decode("a", 5, 0)])
    chain.wait_batches(1)
    chain.lose()
    with pytest.raises(ChainUnavailableError, match="lost"):
        call.result(TIMEOUT_S)
    with pytest.raises(ChainUnavailableError, match="scripted outage"):
        _run(chain, [_decode("b", 5, 0)]).result(TIMEOUT_S)
    chain.is_up, chain.epoch = True, 2  # reconnected: the old session is gone for good
    with pytest.raises(ChainUnavailableError, match="connection that was lost"):
        _run(chain, [_decode("a", 6, 1)]).result(TIMEOUT_S)


def test_a_silent_chain_is_reset_after_the_reply_timeout(chain):
    chain.runtime._reply_timeout_s = 0.2
    with pytest.raises(ChainUnavailableError, match="stopped answering"):
        _run(chain, [_decode("a", 5, 0)]).result(TIMEOUT_S)
    assert chain.resets and "no prediction" in chain.resets[0]
