"""The worker over the real llama.cpp runtime, with the tiny self-written model."""

from __future__ import annotations

import threading

import pytest
from fake_runtime import EventRecorder
from worker_support import barrier, generate, on_worker

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.worker.direct_batch import DirectIteration
from skippyd.engine.worker.generation_events import (
    CompleteEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
)

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = {"a": [1, 10, 20, 30, 40], "b": [1, 50, 60], "c": [1, 70, 80, 90, 100, 110, 120]}
MAX_TOKENS = 6
WAIT_S = 30.0


def open_runtime(path) -> LlamaRuntime:
    return LlamaRuntime(RuntimeOptions(str(path), lane_count=3, ctx_size=256, n_batch=128,
                                       n_ubatch=32, threads=2))


def solo_greedy(runtime: LlamaRuntime, session: str, prompt: list[int]) -> list[int]:
    """Greedy tokens of one session run alone, straight on the runtime."""
    tokens: list[int] = []
    request = IterationRequest(session, prompt, sampling=GREEDY, sample_last=True)
    while len(tokens) < MAX_TOKENS:
        sample = runtime.run_iteration([request]).samples[0]
        if sample.is_eog:
            break
        tokens.append(sample.token)
        request = IterationRequest(session, [sample.token], sampling=GREEDY, sample_last=True,
                                   phase=RowPhase.DECODE)
    return tokens


@pytest.fixture
def llama_runtime(tiny_model_path):
    runtime = open_runtime(tiny_model_path)
    yield runtime
    runtime.close()


def test_scheduled_generation_matches_the_runtime_run_alone(tiny_model_path, llama_runtime,
                                                            make_handle):
    with open_runtime(tiny_model_path) as reference:
        expected = solo_greedy(reference, "a", PROMPTS["a"])
    worker = make_handle(llama_runtime)
    result = generate(worker, PROMPTS["a"], MAX_TOKENS, sampling=GREEDY)
    assert result.tokens == expected
    assert result.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    barrier(worker)
    assert llama_runtime.active_session_count() == 0


def test_concurrent_generations_share_batched_decode_calls(llama_runtime, make_handle,
                                                           blocked_worker):
    worker = make_handle(llama_runtime)
    _, release = blocked_worker(worker)
    recorders = {name: EventRecorder() for name in PROMPTS}
    for name, prompt in PROMPTS.items():
        worker.submit_generation(GenerationRequest(name, prompt, MAX_TOKENS, GREEDY),
                                    recorders[name])
    calls_before = llama_runtime.decode_calls
    release.set()
    total_tokens = 0
    for recorder in recorders.values():
        while isinstance(event := recorder.next(WAIT_S), TokenEvent):
            total_tokens += 1
            event.ack.send(TokenControl.CONTINUE)
        assert isinstance(event, CompleteEvent)
    calls = llama_runtime.decode_calls - calls_before
    # One batched call per step: far fewer calls than tokens produced by three sessions.
    assert calls < total_tokens
    barrier(worker)
    assert llama_runtime.active_session_count() == 0


def test_direct_iterations_run_on_the_real_runtime(llama_runtime, make_batch_handle):
    worker = make_batch_handle(llama_runtime)
    first = worker.submit_iteration(DirectIteration(
        "s", PROMPTS["b"], sampling=GREEDY, sample_last=True)).result(timeout=WAIT_S)
    assert first.predicted >= 0 and first.batch_size == 1
    count = on_worker(worker, lambda rt: rt.session_token_count("s"))
    assert count == len(PROMPTS["b"])
    aligned = worker.submit_iteration(DirectIteration(
        "s", [first.predicted], [2], GREEDY, sample_last=True, phase=RowPhase.DECODE,
        target_token_count=2)).result(timeout=WAIT_S)
    assert aligned.session_alignment.before_token_count == len(PROMPTS["b"])
    assert aligned.session_alignment.after_token_count == 2
    on_worker(worker, lambda rt: rt.drop_session("s"))
    assert llama_runtime.active_session_count() == 0


def test_a_wait_hook_runs_before_every_model_call_and_after_the_last_event(llama_runtime,
                                                                           make_handle):
    """What lets a consumer hold its wake-ups back until the worker waits."""
    worker = make_handle(llama_runtime)
    log: list[str] = []  # appended on the worker thread only
    decodes_at_hook: list[int] = []
    flushed_after_end = threading.Event()

    def hook() -> None:
        log.append("hook")
        decodes_at_hook.append(llama_runtime.decode_calls)
        if "complete" in log:
            flushed_after_end.set()

    def on_event(event) -> None:
        log.append("complete" if isinstance(event, CompleteEvent) else "token")
        if isinstance(event, TokenEvent):
            event.ack.send(TokenControl.CONTINUE)

    calls_before = llama_runtime.decode_calls
    worker.add_wait_hook(hook)
    worker.submit_generation(GenerationRequest("a", PROMPTS["a"], MAX_TOKENS, GREEDY), on_event)
    assert flushed_after_end.wait(WAIT_S)
    barrier(worker)
    calls_after = llama_runtime.decode_calls
    assert calls_after > calls_before
    # Right before each model call (the count it had then), and once more after the end.
    assert set(range(calls_before, calls_after)) <= set(decodes_at_hook)
    assert log.index("complete") < len(log) - 1 - log[::-1].index("hook")
    worker.remove_wait_hook(hook)
    seen = len(log)
    generate(worker, PROMPTS["b"], 2, sampling=GREEDY)
    barrier(worker)
    assert len(log) == seen
