"""Drafted tokens verified in one call: kept while they are what sampling picks, the rest
leave the KV, and generation goes on as if it had decoded one token at a time.

Real llama.cpp with the tiny self-written model (f32 weights). Rows computed in another
batch shape can move the last bits of the logits, so the continuation checks compare with
a plain decode of the same tokens rather than assume one bit-identical run.
"""

from __future__ import annotations

import dataclasses

import pytest
from cache_helpers import (
    GREEDY,
    greedy_continue,
    open_runtime,
    prefill,
    tiny_options,
    tokens,
)

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationRequest,
    RowPhase,
    SamplingConfig,
)


def decode_with(runtime, session: str, pending: int, draft: list[int],
                sampling: SamplingConfig = GREEDY):
    request = IterationRequest(session, [pending], sampling=sampling, sample_last=True,
                               phase=RowPhase.DECODE, draft=draft)
    return runtime.run_iteration([request]).samples[0]


@pytest.fixture
def reference(tiny_model_path) -> list[int]:
    """The first 12 greedy tokens after a fixed prompt, decoded one at a time."""
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        return greedy_continue(runtime, "r", tokens(1, 20), 12)


def test_a_right_draft_is_kept_whole_and_the_next_token_comes_with_it(tiny_model_path,
                                                                      reference):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        first = greedy_continue(runtime, "s", tokens(1, 20), 1)[0]
        sample = decode_with(runtime, "s", first, reference[1:5])
        assert [s.token for s in sample.tokens] == reference[1:6]
        assert sample.drafted == 4 and len(sample.followers) == 4
        # The pending token and the four drafts are in the KV; the fifth is pending.
        assert runtime.session_token_count("s") == 20 + 5
        assert runtime.session_history("s") == tuple(tokens(1, 20) + reference[:5])
        later = greedy_continue(runtime, "s", [reference[5]], 6)
        assert later == reference[6:12]


def test_a_wrong_draft_is_cut_at_its_first_miss_and_its_rows_leave_the_kv(tiny_model_path,
                                                                           reference):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        first = greedy_continue(runtime, "s", tokens(1, 20), 1)[0]
        wrong = (reference[3] + 1) % 290 + 3
        sample = decode_with(runtime, "s", first, [reference[1], reference[2], wrong, 7])
        # Two drafts kept, then the model's own token instead of the wrong one.
        assert [s.token for s in sample.tokens] == reference[1:4]
        assert sample.drafted == 4
        assert runtime.session_token_count("s") == 20 + 3
        assert runtime.kv_cells_used() == 20 + 3  # the two rejected rows are gone
        assert greedy_continue(runtime, "s", [reference[3]], 8) == reference[4:12]


def test_a_sampled_request_draws_the_same_tokens_with_drafts_as_without(tiny_model_path):
    sampling = SamplingConfig(temperature=1.0, top_k=20, seed=11, ignore_eos=True)

    def run(use_drafts: bool) -> list[int]:
        with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
            request = IterationRequest("s", tokens(2, 20), sampling=sampling, sample_last=True)
            out = [runtime.run_iteration([request]).samples[0].token]
            while len(out) < 16:
                # A draft that is right where the plain run went, wrong once in a while.
                draft = plain[len(out):len(out) + 3] if use_drafts else []
                draft = [t if i != 2 else 5 for i, t in enumerate(draft)]
                sample = decode_with(runtime, "s", out[-1], draft, sampling)
                out.extend(s.token for s in sample.tokens)
            return out[:16]

    plain: list[int] = []
    plain = run(False)
    assert run(True) == plain


def test_an_end_of_generation_ends_the_verification(tiny_model_path, reference):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        eos = 2
        first = greedy_continue(runtime, "s", tokens(1, 20), 1)[0]
        biased = SamplingConfig(temperature=0.0, logit_bias=((eos, 1e9),))
        sample = decode_with(runtime, "s", first, [eos, 9, 9], biased)
        assert [s.token for s in sample.tokens] == [eos] and sample.tokens[-1].is_eog
        assert runtime.session_token_count("s") == 21


def test_drafts_are_refused_without_sampling_or_beyond_the_lane(tiny_model_path):
    with open_runtime(tiny_model_path, lanes=2, ctx_size=512) as runtime:
        prefill(runtime, "s", tokens(3, 200))
        with pytest.raises(InvalidIterationError, match="drafts need"):
            runtime.run_iteration([IterationRequest("s", [5], draft=[6, 7])])
        with pytest.raises(InvalidIterationError, match="beyond its lane"):
            decode_with(runtime, "s", 5, [6] * 60)  # a lane holds 256 tokens
        assert runtime.session_token_count("s") == 200


def test_a_final_stage_fed_rows_verifies_drafts_like_the_whole_model(tiny_model_path,
                                                                     reference, tmp_path):
    # A split pipeline: stage 0 computes the pending token and the drafts as plain rows,
    # the final stage gets those rows with the drafts named, and verifies them.
    from skippyd.engine.runtime.llama import LlamaRuntime
    from skippyd.model_files.slice import slice_model

    head = slice_model(tiny_model_path, 0, 2, tmp_path / "head.gguf")
    tail = slice_model(tiny_model_path, 2, 4, tmp_path / "tail.gguf")
    options = tiny_options(head, lanes=2, ctx_size=1024)
    with LlamaRuntime(dataclasses.replace(options, final_stage=False)) as first, \
            LlamaRuntime(dataclasses.replace(options, model_path=str(tail),
                                             first_stage=False)) as final:
        def step(session_tokens: list[int], draft: list[int], position: int):
            out = first.run_iteration([IterationRequest("s", session_tokens + draft)])
            rows = out.output_rows[0]
            request = IterationRequest("s", session_tokens, input_rows=rows,
                                       positions=range(position,
                                                       position + len(session_tokens)),
                                       sampling=GREEDY, sample_last=True, draft=draft)
            return final.run_iteration([request]).samples[0]

        assert step(tokens(1, 20), [], 0).token == reference[0]
        wrong = (reference[3] + 1) % 290 + 3
        sample = step([reference[0]], [reference[1], reference[2], wrong], 20)
        assert [s.token for s in sample.tokens] == reference[1:4] and sample.drafted == 3
        assert final.session_token_count("s") == 23  # the rejected row left the KV
        first.trim_session("s", 23)
        sample = step([reference[3]], reference[4:8], 23)
        assert [s.token for s in sample.tokens] == reference[4:9]
        with pytest.raises(InvalidIterationError, match="drafts only"):
            final.run_iteration([IterationRequest(
                "s", [], input_rows=first.run_iteration([IterationRequest(
                    "t", [5, 6])]).output_rows[0], sample_last=True, draft=[5, 6])])
