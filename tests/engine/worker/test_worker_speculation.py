"""Speculative decoding through the worker: drafts ride on decode rows, accepted tokens
come out as ordinary token events, and a request gets what it would have got without.

The scripted runtime verifies drafts against its script the way llama.cpp's sampling
would (a draft is kept while it is the token sampled before it), which pins the worker's
side exactly; the tiny real model checks the whole path once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_runtime import FakeRuntime
from worker_support import barrier, generate

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.draft_length import DraftControl
from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.worker.drafting import Speculation, SpeculationSettings
from skippyd.engine.worker.generation_events import TokenControl

GREEDY = SamplingConfig(temperature=0.0, ignore_eos=True)
PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]


class TaughtControl(DraftControl):
    """A control that has seen decode steps cost 10 ms plus 1 ms a row (drafts pay), and
    learns nothing more: the scripted runtime's steps take no time worth learning from."""

    def __init__(self, max_draft: int) -> None:
        super().__init__(min_draft=2, max_draft=max_draft)
        for rows in (1, 2, 4, 7, 3):
            work = [IterationWork(f"s{i}", (1,), (5,), True, IterationPhase.DECODE)
                    for i in range(rows)]
            super().observe(IterationPlan(work=work, token_count=rows), (10 + rows) / 1000)

    def observe(self, plan: IterationPlan, elapsed_s: float) -> None:
        pass


def speculating(max_session_tokens: int = 4096, max_draft: int = 6, *,
                split_by_sequence: bool = False) -> Speculation:
    return Speculation(SpeculationSettings("ngram", 2, max_draft, split_by_sequence),
                       max_session_tokens, control=TaughtControl(max_draft))


def test_a_request_that_repeats_its_prompt_gets_several_tokens_a_step(make_handle):
    # The prompt holds the pattern twice; the script continues it, as a copying model would.
    script = PATTERN * 3
    runtime = FakeRuntime(lane_count=2, script={"r": script})
    worker = make_handle(runtime, speculation=speculating())
    result = generate(worker, [1, *PATTERN, *PATTERN], 20, request_id="r")
    assert result.tokens == script[:20] and result.finish_reason == "length"
    assert result.accepted > 0 and result.drafted >= result.accepted
    decode_calls = [call for call in runtime.calls if call[0].token_ids[:1] != (1,)]
    assert len(decode_calls) < 19, "some steps yielded several tokens"
    assert any(call[0].draft for call in runtime.calls)
    stats = worker.stats()
    assert (stats.num_drafted, stats.num_draft_accepted) == (result.drafted, result.accepted)
    assert stats.speculation == "ngram"


def test_accepted_tokens_never_go_past_max_tokens(make_handle):
    runtime = FakeRuntime(lane_count=2, script={"r": PATTERN * 3})
    worker = make_handle(runtime, speculation=speculating(max_draft=8))
    result = generate(worker, [1, *PATTERN, *PATTERN], 5, request_id="r")
    assert result.tokens == PATTERN[:5] and result.finish_reason == "length"
    barrier(worker)
    assert runtime.active_session_count() == 0


def test_an_end_of_generation_among_accepted_tokens_ends_the_request_there(make_handle):
    script = [*PATTERN[:4], 99, *PATTERN[5:]]
    runtime = FakeRuntime(lane_count=2, script={"r": script}, eog_tokens=[99])
    worker = make_handle(runtime, speculation=speculating())
    result = generate(worker, [1, *PATTERN, *PATTERN], 20, request_id="r",
                      sampling=SamplingConfig(temperature=0.0))
    assert result.tokens == PATTERN[:4] and result.finish_reason == "stop"


def test_a_stop_among_accepted_tokens_ends_the_request_there(make_handle):
    runtime = FakeRuntime(lane_count=2, script={"r": PATTERN * 3})
    worker = make_handle(runtime, speculation=speculating())
    result = generate(worker, [1, *PATTERN, *PATTERN], 20, request_id="r",
                      on_token=lambda token: (TokenControl.STOP if token == 14
                                              else TokenControl.CONTINUE))
    assert result.tokens == PATTERN[:4] and result.finish_reason == "stop"
    barrier(worker)
    assert runtime.active_session_count() == 0


def test_a_request_that_opts_out_never_carries_drafts(make_handle):
    runtime = FakeRuntime(lane_count=2, script={"r": PATTERN * 3})
    worker = make_handle(runtime, speculation=speculating())
    result = generate(worker, [1, *PATTERN, *PATTERN], 12, request_id="r",
                      speculative=False)
    assert result.tokens == (PATTERN * 3)[:12] and result.drafted == 0
    assert not any(request.draft for call in runtime.calls for request in call)


def test_drafts_that_are_never_accepted_stop_being_drafted(make_handle):
    # "11 12" comes back every third token, always followed by something new: each time
    # the last time suggests a draft, and it is wrong.
    runtime = FakeRuntime(lane_count=2, default_token=lambda _request, count: (
        11, 12, 400 + count)[count % 3])
    worker = make_handle(runtime, speculation=speculating())
    result = generate(worker, [1, 2, 3], 90, request_id="r")
    assert len(result.tokens) == 90 and result.accepted == 0
    drafted_rows = [request for call in runtime.calls for request in call if request.draft]
    assert 0 < len(drafted_rows) < 12, len(drafted_rows)  # of some 30 chances


def test_with_a_stream_per_lane_drafts_ride_only_on_a_lone_row(make_handle):
    # Beside another sequence's rows, a per-lane runtime would compute the drafts in a
    # micro-batch of their own: a second pass over the weights for a few guesses.
    runtime = FakeRuntime(lane_count=2, script={"a": PATTERN * 6, "b": PATTERN * 6})
    worker = make_handle(runtime, speculation=speculating(split_by_sequence=True))
    prompt = [1, *PATTERN, *PATTERN]
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(generate, worker, prompt, 40, request_id="a")
        short = pool.submit(generate, worker, prompt, 8, request_id="b")
        alone, beside = long.result(), short.result()
    shared = [call for call in runtime.calls if len(call) > 1]
    assert shared, "the two requests never shared a step"
    assert not any(request.draft for call in shared for request in call)
    assert alone.tokens == (PATTERN * 6)[:40] and beside.tokens == PATTERN
    assert alone.drafted > 0  # on its own once the short one ended


@pytest.mark.parametrize("layout", ["unified", "per_lane"])
def test_real_drafts_give_the_tokens_plain_decoding_gives(tiny_model_path, make_handle,
                                                          layout):
    def run(speculation: Speculation | None):
        options = RuntimeOptions(str(tiny_model_path), lane_count=2, ctx_size=1024,
                                 kv_unified=layout == "unified", n_batch=256, n_ubatch=64,
                                 threads=2)
        with LlamaRuntime(options) as runtime:
            worker = make_handle(runtime, speculation=speculation)
            prompt = [1] + [3 + (i * 7) % 40 for i in range(60)]  # a repeating prompt
            return generate(worker, prompt, 80, sampling=GREEDY)

    plain = run(None)
    drafted = run(speculating(max_session_tokens=512))
    assert drafted.drafted > 0
    assert drafted.tokens == plain.tokens

