"""One KV pool shared by every lane: a request may use all of it, the pool runs out
mid-decode, and what the lanes kept for the prefix cache gives way first.

Real llama.cpp with the tiny self-written model. Rows batched with others, or cells at
other places in the pool, move the last bits of the logits, so a long greedy run is not
compared token for token with a solo run: instead every token it produced must be a
greedy pick of the model fed the same text alone (:func:`assert_greedy_continuation`).
A preemption that recomputed wrongly (lost or shifted KV) breaks that within a few tokens.
"""

from __future__ import annotations

import threading

import pytest
from worker_support import barrier, generate

from skippyd.engine.prefix_cache import LivePrefixCache, PrefixCacheSettings
from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions

GREEDY = SamplingConfig(temperature=0.0, ignore_eos=True)


def shared_runtime(path, *, ctx_size: int, lanes: int = 2) -> LlamaRuntime:
    return LlamaRuntime(RuntimeOptions(str(path), lane_count=lanes, ctx_size=ctx_size,
                                       kv_unified=True, n_batch=256, n_ubatch=64, threads=2))


def solo(path, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one request alone in a pool of its own."""
    with shared_runtime(path, ctx_size=1024, lanes=1) as runtime:
        tokens: list[int] = []
        request = IterationRequest("solo", prompt, sampling=GREEDY, sample_last=True)
        while len(tokens) < max_tokens:
            tokens.append(runtime.run_iteration([request]).samples[0].token)
            request = IterationRequest("solo", [tokens[-1]], sampling=GREEDY,
                                       sample_last=True, phase=RowPhase.DECODE)
        return tokens


#: Log-probability by which a token may trail the best one (batch-shape noise).
GREEDY_TOLERANCE = 0.05


def assert_greedy_continuation(path, prompt: list[int], tokens: list[int]) -> None:
    """Every token of ``tokens`` is (within noise) the most likely after what precedes it."""
    sampling = SamplingConfig(temperature=0.0, ignore_eos=True, logprobs=4)
    with shared_runtime(path, ctx_size=1024, lanes=1) as runtime:
        request = IterationRequest("check", prompt, sampling=sampling, sample_last=True)
        for index, token in enumerate(tokens):
            logprob = runtime.run_iteration([request]).samples[0].logprob
            assert logprob is not None and logprob.top
            best = logprob.top[0][1]
            mine = dict(logprob.top).get(token, float("-inf"))
            assert mine >= best - GREEDY_TOLERANCE, (
                f"token {index} ({token}) trails the best {logprob.top[0]} by {best - mine}")
            request = IterationRequest("check", [token], sampling=sampling, sample_last=True,
                                       phase=RowPhase.DECODE)


def prompt(seed: int, length: int) -> list[int]:
    return [1] + [3 + (seed * 31 + i * 7) % 280 for i in range(length - 1)]


def test_the_greedy_check_refuses_tokens_that_continue_other_text(tiny_model_path):
    tokens = solo(tiny_model_path, prompt(8, 20), 40)
    assert_greedy_continuation(tiny_model_path, prompt(8, 20), tokens)
    with pytest.raises(AssertionError, match="trails the best"):
        assert_greedy_continuation(tiny_model_path, prompt(9, 20), tokens)


def test_one_session_may_hold_more_than_a_lanes_share(tiny_model_path):
    with shared_runtime(tiny_model_path, ctx_size=512, lanes=4) as runtime:
        assert runtime.shares_kv_pool
        assert runtime.max_session_tokens == runtime.kv_pool_tokens >= 512
        long = prompt(1, 400)
        for start in range(0, len(long), 200):  # n_batch is 256
            runtime.run_iteration([IterationRequest("long", long[start:start + 200])])
        assert runtime.session_token_count("long") == 400  # a per-lane stream holds 128


def test_a_prefix_copied_in_one_pool_shares_its_cells_and_continues_the_same(tiny_model_path):
    shared = prompt(2, 96)
    with shared_runtime(tiny_model_path, ctx_size=512) as runtime:
        runtime.run_iteration([IterationRequest("first", shared)])
        runtime.drop_session("first")  # its lane keeps the KV
        (lane,) = [lane for lane in runtime.idle_lanes() if runtime.lane_history(lane)]
        runtime.ensure_session_active("second")
        runtime.copy_lane_prefix(lane, "second", 64)
        assert runtime.session_history("second") == tuple(shared[:64])
        rest = IterationRequest("second", shared[64:], sampling=GREEDY, sample_last=True)
        copied = runtime.run_iteration([rest]).samples[0].token
    with shared_runtime(tiny_model_path, ctx_size=512) as fresh:
        whole = IterationRequest("x", shared, sampling=GREEDY, sample_last=True)
        assert fresh.run_iteration([whole]).samples[0].token == copied


def test_when_the_pool_runs_out_mid_decode_the_youngest_recomputes_and_both_finish(
        tiny_model_path, make_handle):
    # Each reserves its prompt plus 512 tokens at admission (1 064 of 1 280 cells), then
    # grows to 720: the pool runs out and the later admission gives its cells back.
    prompts = {"old": prompt(3, 20), "young": prompt(4, 20)}
    with shared_runtime(tiny_model_path, ctx_size=1280) as runtime:
        worker = make_handle(runtime)
        results: dict[str, list[int]] = {}

        def run(name: str) -> None:
            results[name] = generate(worker, prompts[name], 700, request_id=name,
                                     sampling=GREEDY).tokens

        threads = [threading.Thread(target=run, args=(name,)) for name in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert worker.stats().num_preempted >= 1
        for name, tokens in results.items():
            assert len(tokens) == 700, name  # nothing was cut short
            assert_greedy_continuation(tiny_model_path, prompts[name], tokens)
        barrier(worker)
        assert runtime.active_session_count() == 0


def test_kept_prefixes_give_their_cells_back_before_anyone_is_preempted(
        tiny_model_path, make_handle):
    settings = PrefixCacheSettings(min_tokens=16, host_tier=True, host_ram_bytes=64 << 20)
    with shared_runtime(tiny_model_path, ctx_size=1024) as runtime:
        cache = LivePrefixCache(runtime, settings, namespace="test")
        worker = make_handle(runtime, prefix_cache=cache)
        generate(worker, prompt(5, 400), 8, request_id="kept", sampling=GREEDY)
        barrier(worker)
        assert sum(len(runtime.lane_history(lane)) for lane in runtime.idle_lanes()) >= 400
        # 400 kept cells + 20 + 700 of this request do not fit 1 024 cells.
        tokens = generate(worker, prompt(6, 20), 700, request_id="long", sampling=GREEDY).tokens
        assert len(tokens) == 700
        assert_greedy_continuation(tiny_model_path, prompt(6, 20), tokens)
        assert worker.stats().num_preempted == 0
        assert cache.stats().entries_host >= 1  # the kept prefix went to host RAM


@pytest.mark.parametrize("layout", ["unified", "per_lane"])
def test_both_layouts_serve_the_same_greedy_tokens(tiny_model_path, make_handle, layout):
    options = RuntimeOptions(str(tiny_model_path), lane_count=2, ctx_size=512,
                             kv_unified=layout == "unified", n_batch=256, n_ubatch=64,
                             threads=2)
    with LlamaRuntime(options) as runtime:
        worker = make_handle(runtime)
        tokens = generate(worker, prompt(7, 30), 40, sampling=GREEDY).tokens
    assert tokens == solo(tiny_model_path, prompt(7, 30), 40)
