"""LlamaRuntime on real llama.cpp with the tiny test model: lanes, batches, sampling."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationRequest,
    LanesBusyError,
    RowPhase,
    SamplingConfig,
    SessionAlignment,
)
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.sampling import SamplerChain
from skippyd.engine.runtime.token_logprobs import row_logits
from skippyd.engine.runtime.tokenizer import Tokenizer

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    tok = Tokenizer(tiny_model_path)
    yield tok
    tok.close()


def small_runtime(model_path, lanes: int, ctx_size: int) -> LlamaRuntime:
    return LlamaRuntime(RuntimeOptions(str(model_path), lane_count=lanes, ctx_size=ctx_size,
                                       n_batch=128, n_ubatch=32, threads=2))


@pytest.fixture
def runtime(tiny_model_path):
    with small_runtime(tiny_model_path, 3, 256) as rt:
        yield rt


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.tokenize(text)


def generate(rt, sessions: dict[str, list[int]], steps: int, sampling=GREEDY) -> dict:
    """Prefill every session in one batch, then decode them together ``steps`` times."""
    reqs = [IterationRequest(s, toks, sampling=sampling, sample_last=True) for s, toks in sessions.items()]
    out = rt.run_iteration(reqs)
    generated = {reqs[s.request_index].session_id: [s.token] for s in out.samples}
    for _ in range(steps - 1):
        reqs = [
            IterationRequest(s, [g[-1]], sampling=sampling, sample_last=True,
                             phase=RowPhase.DECODE)
            for s, g in generated.items()
        ]
        out = rt.run_iteration(reqs)
        for sample in out.samples:
            generated[reqs[sample.request_index].session_id].append(sample.token)
    return generated


def logits_row(rt, row: int) -> np.ndarray:
    ptr = L.llama_get_logits_ith(rt.context, row)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                 shape=(rt.n_vocab,)).copy()


def test_one_decode_call_serves_many_sessions(runtime, tokenizer):
    calls_before = runtime.decode_calls
    out = generate(runtime, {"a": prompt(tokenizer, "the cat"), "b": prompt(tokenizer, "a dog"),
                             "c": prompt(tokenizer, "hello")}, steps=5)
    assert sorted(out) == ["a", "b", "c"]
    assert all(len(toks) == 5 for toks in out.values())
    assert runtime.decode_calls - calls_before == 5  # one llama_decode per iteration
    assert runtime.active_session_count() == 3


def test_lane_exhaustion_is_typed_and_changes_nothing(runtime, tokenizer):
    for s in ("a", "b", "c"):
        runtime.ensure_session_active(s)
    with pytest.raises(LanesBusyError, match="all execution lanes are busy"):
        runtime.ensure_session_active("d")
    runtime.drop_session("a")
    with pytest.raises(LanesBusyError, match="requires 2 new sessions but only 1"):
        runtime.run_iteration([
            IterationRequest("d", prompt(tokenizer, "a")),
            IterationRequest("e", prompt(tokenizer, "b")),
        ])
    assert runtime.active_session_count() == 2
    runtime.ensure_session_active("d")  # the lane freed by drop_session is usable
    assert runtime.session_token_count("d") == 0


def test_duplicate_session_in_one_call_is_rejected(runtime, tokenizer):
    toks = prompt(tokenizer, "the cat")
    with pytest.raises(InvalidIterationError, match="duplicate session a"):
        runtime.run_iteration([IterationRequest("a", toks), IterationRequest("a", toks)])
    assert runtime.active_session_count() == 0
    assert runtime.decode_calls == 0


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"token_ids": [10_000]}, "outside the vocabulary"),
        ({"token_ids": []}, "no tokens"),
        ({"input_rows": np.zeros((2, 64), np.float32)}, "takes tokens, not rows"),
        ({"token_ids": [5, 6], "positions": [0, 2]}, "consecutive"),
        ({"token_ids": [5, 6], "positions": [3, 4]}, "would leave a gap"),
        ({"token_ids": [5] * 129}, "n_batch is 128"),
        ({"token_ids": [5], "sampling": SamplingConfig(top_p=2.0)}, "top_p"),
    ],
)
def test_malformed_requests_are_rejected_without_side_effects(runtime, request_kwargs, message):
    with pytest.raises(InvalidIterationError, match=message):
        runtime.run_iteration([IterationRequest("a", **request_kwargs)])
    assert runtime.active_session_count() == 0
    assert runtime.decode_calls == 0


def test_a_full_lane_refuses_more_and_the_other_lanes_go_on(tiny_model_path, tokenizer):
    options = RuntimeOptions(str(tiny_model_path), lane_count=3, ctx_size=768, n_batch=256,
                             n_ubatch=32, threads=2)
    with LlamaRuntime(options) as rt:
        assert rt.kv_pool_tokens == 768 and rt.max_session_tokens == 256
        rt.run_iteration([IterationRequest("a", [5] * 200)])
        # Lanes do not share cells: a second long session fits beside the first.
        rt.run_iteration([IterationRequest("b", [6] * 200)])
        with pytest.raises(InvalidIterationError, match="beyond its lane"):
            rt.run_iteration([IterationRequest("a", [7] * 60, sample_last=True)])
        assert rt.session_token_count("a") == 200  # nothing changed
        out = rt.run_iteration([IterationRequest("a", [7] * 56, sample_last=True)])
        assert len(out.samples) == 1 and rt.session_token_count("a") == 256


def test_trim_and_align(runtime, tokenizer):
    toks = prompt(tokenizer, "the cat and the dog")
    first = generate(runtime, {"a": toks}, steps=6)["a"]
    assert runtime.session_token_count("a") == len(toks) + 5
    assert runtime.align_session_to_token_count_if_ahead("a", 10_000) is None  # never extends
    assert runtime.align_session_to_token_count_if_ahead("missing", 3) is None
    alignment = runtime.align_session_to_token_count_if_ahead("a", len(toks))
    assert alignment == SessionAlignment(before_token_count=len(toks) + 5,
                                         after_token_count=len(toks))
    assert runtime.session_token_count("a") == len(toks)
    # Continuing after the trim reproduces the first run exactly.
    out = runtime.run_iteration(
        [IterationRequest("a", [first[0]], sampling=GREEDY, sample_last=True)]
    )
    assert out.samples[0].token == first[1]
    runtime.trim_session("a", 2)
    assert runtime.session_token_count("a") == 2


def test_explicit_positions_replay_the_last_token(runtime, tokenizer):
    toks = prompt(tokenizer, "hello world")
    out = runtime.run_iteration([IterationRequest("a", toks, sample_last=True)])
    n = len(toks)
    replay = runtime.run_iteration(
        [IterationRequest("a", toks[-1:], positions=[n - 1], sample_last=True)]
    )
    assert replay.samples[0].token == out.samples[0].token
    assert runtime.session_token_count("a") == n


def test_no_cross_talk_between_sessions(runtime, tokenizer):
    """X's logits are bit-identical next to B or next to C of the same shape: a session
    never sees another's content, only the batch's shape can change its numbers."""
    x = prompt(tokenizer, "the cat is")
    b = prompt(tokenizer, "a dog and")
    c = [b[0], *reversed(b[1:])]  # other content, same shape
    assert c != b

    def run_x_with(other: list[int], other_first: bool) -> np.ndarray:
        for s in ("x", "o"):
            runtime.drop_session(s)
        # Rows go into the batch in lane order: the lanes decide who comes first.
        runtime.ensure_session_active("x", lane=1 if other_first else 0)
        runtime.ensure_session_active("o", lane=0 if other_first else 1)
        reqs = [IterationRequest("x", x, sample_last=True), IterationRequest("o", other, sample_last=True)]
        runtime.run_iteration(reqs)
        row = len(other) + len(x) - 1 if other_first else len(x) - 1
        return logits_row(runtime, row)

    with_b = run_x_with(b, other_first=False)
    with_c = run_x_with(c, other_first=False)
    assert np.array_equal(with_b, with_c)
    with_b_first = run_x_with(b, other_first=True)
    with_c_first = run_x_with(c, other_first=True)
    assert np.array_equal(with_b_first, with_c_first)
    runtime.drop_session("x")
    runtime.drop_session("o")
    runtime.run_iteration([IterationRequest("x", x, sample_last=True)])
    solo = logits_row(runtime, len(x) - 1)
    # Batched vs solo: different kernels may be picked for different batch shapes.
    assert np.max(np.abs(solo - with_b)) < 1e-3


def test_seeded_sampling_is_reproducible(runtime, tokenizer):
    toks = prompt(tokenizer, "the dog")
    sampling = SamplingConfig(temperature=1.5, seed=1234)
    first = generate(runtime, {"a": toks}, steps=8, sampling=sampling)["a"]
    runtime.drop_session("a")
    second = generate(runtime, {"a": toks}, steps=8, sampling=sampling)["a"]
    runtime.drop_session("a")
    other = generate(runtime, {"a": toks}, steps=8,
                     sampling=SamplingConfig(temperature=1.5, seed=99))["a"]
    assert first == second
    assert first != other


def test_logit_bias_and_ignore_eos(runtime, tokenizer):
    toks = prompt(tokenizer, "the")
    eos = tokenizer.eos_token_id
    forced = SamplingConfig(temperature=0.0, logit_bias=((eos, 100.0),))
    out = runtime.run_iteration([IterationRequest("a", toks, sampling=forced, sample_last=True)])
    assert out.samples[0].token == eos and out.samples[0].is_eog
    ignored = SamplingConfig(temperature=0.0, logit_bias=((eos, 100.0),), ignore_eos=True)
    out = runtime.run_iteration([IterationRequest("b", toks, sampling=ignored, sample_last=True)])
    assert not out.samples[0].is_eog


def test_frequency_penalty_sees_prompt_and_generated_tokens(runtime, tokenizer):
    toks = prompt(tokenizer, "the cat")
    penalised = SamplingConfig(temperature=0.0, frequency_penalty=50.0, penalty_last_n=-1)
    generated = generate(runtime, {"a": toks}, steps=12, sampling=penalised)["a"]
    assert len(set(generated)) == len(generated)
    assert not set(generated) & set(toks)


def test_non_final_stage_cannot_sample(tiny_model_path, tokenizer):
    options = RuntimeOptions(str(tiny_model_path), lane_count=2, ctx_size=128, n_batch=64,
                             n_ubatch=32, threads=2, final_stage=False)
    with LlamaRuntime(options) as rt:
        with pytest.raises(InvalidIterationError, match="only the final stage"):
            rt.run_iteration([IterationRequest("a", [5, 6], sample_last=True)])
        out = rt.run_iteration([IterationRequest("a", [5, 6, 7])])
        assert out.output_rows[0].shape == (3, 64)
        assert out.output_rows[0].dtype == np.float32


def test_row_logits_is_a_read_only_view_of_the_context_row(runtime, tokenizer):
    toks = prompt(tokenizer, "the cat")
    runtime.run_iteration([IterationRequest("a", toks, sampling=GREEDY,
                                                      sample_last=True)])
    row = len(toks) - 1
    view = row_logits(runtime.context, row, runtime.n_vocab)
    assert view.dtype == np.float32 and view.shape == (runtime.n_vocab,)
    np.testing.assert_array_equal(view, logits_row(runtime, row))
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 0.0


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("best", ["plain", "end-of-generation", "tie"])
def test_the_greedy_argmax_picks_what_the_llama_cpp_chain_picks(runtime, tokenizer,
                                                               ignore_eos, best):
    toks = prompt(tokenizer, "the cat sat on the mat")
    runtime.run_iteration([IterationRequest("a", toks, sampling=GREEDY,
                                                      sample_last=True)])
    row = len(toks) - 1
    # Shape the row's logits in place (the sampler reads the context's own buffer).
    logits = np.ctypeslib.as_array(
        ctypes.cast(L.llama_get_logits_ith(runtime.context, row), ctypes.POINTER(ctypes.c_float)),
        shape=(runtime.n_vocab,))
    eog = sorted(runtime.eog_tokens)
    if best == "end-of-generation":
        logits[eog[0]] = logits.max() + 5.0
    elif best == "tie":
        logits[[7, 9]] = logits.max() + 1.0  # the first highest wins, both ways
    config = SamplingConfig(temperature=0.0, ignore_eos=ignore_eos)
    fast = SamplerChain(config, n_vocab=runtime.n_vocab, n_ctx=256, eog_tokens=eog)
    chain = SamplerChain(config, n_vocab=runtime.n_vocab, n_ctx=256, eog_tokens=eog)
    chain._argmax = False  # force the llama.cpp chain the argmax stands in for
    numpy_pick = SamplerChain(config, n_vocab=runtime.n_vocab, n_ctx=256, eog_tokens=eog)
    numpy_pick._pick = None  # the numpy argmax the compiled pick stands in for
    try:
        picked = fast.sample(runtime.context, row)
        assert picked == chain.sample(runtime.context, row)
        assert picked == numpy_pick.sample(runtime.context, row)
        if best == "end-of-generation":
            assert (picked in eog) is not ignore_eos
        if best == "tie":
            assert picked == 7
    finally:
        fast.close()
        chain.close()
        numpy_pick.close()


def test_greedy_rows_of_a_mixed_batch_pick_their_own_rows_argmax(runtime, tokenizer):
    """Each greedy request reads its own row, whatever else the batch holds: rows of a
    prompt log-probability request (every row an output), other samplers, requests given
    out of lane order."""
    prompts = {"a": prompt(tokenizer, "the cat sat"), "b": prompt(tokenizer, "a dog ran off"),
               "c": prompt(tokenizer, "hello there")}
    configs = {"a": SamplingConfig(temperature=0.0, logprobs=2),
               "b": SamplingConfig(temperature=0.0, prompt_logprobs=1),
               "c": SamplingConfig(temperature=1.5, seed=7)}
    for lane, session in enumerate(prompts):
        runtime.ensure_session_active(session, lane=lane)
    order = ["c", "a", "b"]  # requests out of lane order
    out = runtime.run_iteration([
        IterationRequest(s, prompts[s], sampling=configs[s], sample_last=True) for s in order])
    assert [sample.request_index for sample in out.samples] == [0, 1, 2]
    tokens = {order[sample.request_index]: sample for sample in out.samples}
    last_row = {"a": len(prompts["a"]) - 1,
                "b": len(prompts["a"]) + len(prompts["b"]) - 1}  # batch rows in lane order
    for session, row in last_row.items():
        logits = logits_row(runtime, row)
        assert tokens[session].token == int(logits.argmax())
    logprob = tokens["a"].logprob
    assert logprob is not None and logprob.token == tokens["a"].token
    assert logprob.top[0][0] == tokens["a"].token
    assert set(out.prompt_logprobs) == {2}


@pytest.fixture
def runtime4(tiny_model_path):
    with small_runtime(tiny_model_path, 4, 512) as rt:
        yield rt


def replay_last_logits(rt, lane: int, tokens: list[int]) -> np.ndarray:
    """Logits of re-running ``tokens``' last token on the lane's kept KV (then ended)."""
    rt.ensure_session_active("probe", lane=lane, keep_tokens=len(tokens) - 1)
    rt.run_iteration([IterationRequest("probe", tokens[-1:], sample_last=True,
                                                 positions=[len(tokens) - 1])])
    logits = logits_row(rt, 0)
    rt.drop_session("probe")
    return logits


def test_a_lane_between_the_batch_lanes_gets_a_filler_row_and_keeps_its_cells(runtime4,
                                                                              tokenizer):
    kept = prompt(tokenizer, "a lane that keeps its prompt")
    runtime4.ensure_session_active("kept", lane=2)
    runtime4.run_iteration([IterationRequest("kept", kept, sample_last=True)])
    runtime4.drop_session("kept")  # lane 2 is idle and holds the prompt for reuse
    before = replay_last_logits(runtime4, 2, kept)
    for lane, text in ((0, "the cat"), (1, "a dog"), (3, "hello")):
        runtime4.ensure_session_active(text, lane=lane)
    sessions = {"the cat": prompt(tokenizer, "the cat"), "a dog": prompt(tokenizer, "a dog"),
                "hello": prompt(tokenizer, "hello")}
    generated = generate(runtime4, sessions, steps=4)
    assert runtime4._batch.n_tokens == 4  # three decode rows and lane 2's filler
    mem = L.llama_get_memory(runtime4.context)
    assert L.llama_memory_seq_pos_max(mem, 2) == len(kept) - 1  # the filler is gone
    assert all(len(tokens) == 4 for tokens in generated.values())
    assert np.array_equal(replay_last_logits(runtime4, 2, kept), before)


def test_distant_lanes_are_not_padded(runtime4, tokenizer):
    runtime4.ensure_session_active("a", lane=0)
    runtime4.ensure_session_active("b", lane=3)
    generate(runtime4, {"a": prompt(tokenizer, "the cat"), "b": prompt(tokenizer, "a dog")},
             steps=2)
    assert runtime4._batch.n_tokens == 2  # two holes for two rows: two small evaluations
    assert L.llama_memory_seq_pos_max(L.llama_get_memory(runtime4.context), 1) == -1
