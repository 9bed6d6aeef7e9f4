"""``n > 1`` choices through the worker on the tiny model: one prompt prefill, forked.

A counting wrapper around the real runtime records which tokens each session computed,
so the tests see that a follower computes its prompt's last token only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from cache_helpers import GREEDY, SETTINGS, Collector, tiny_options, tokens

from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime
from skippyd.engine.worker.generation_events import (
    GenerationRequest,
    PromptLogprobsEvent,
    TokenEvent,
)
from skippyd.engine.worker.handle import GenerationHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.worker_errors import RequestCancelledError

PROMPT = tokens(5, 80)


class CountingRuntime(LlamaRuntime):
    """The real runtime, counting the tokens each session computed and its forks."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.computed: Counter[str] = Counter()
        self.forks: list[tuple[str, str, int | None]] = []

    def run_iteration(self, requests):
        for request in requests:
            self.computed[request.session_id] += request.num_tokens
        return super().run_iteration(requests)

    def fork_session(self, src, dst, num_tokens=None):
        self.forks.append((src, dst, num_tokens))
        super().fork_session(src, dst, num_tokens)


@pytest.fixture
def stack(tiny_model_path):
    opened = []

    def build(*, lanes: int = 4, cache: bool = False):
        runtime = counting = CountingRuntime(
            tiny_options(tiny_model_path, lanes=lanes, ctx_size=256 * lanes))
        hub = TelemetryHub()
        live = (LivePrefixCache(counting, SETTINGS, namespace="tiny:0-4", publish=hub.publish)
                if cache else None)
        settings = WorkerSettings.derive(counting, queue_capacity=8)
        worker = GenerationHandle(counting, settings, telemetry=hub, prefix_cache=live)
        opened.append((worker, runtime))
        return worker, counting

    yield build
    for worker, runtime in opened:
        worker.close()
        runtime.close()


def submit_choices(worker, n: int, max_tokens: int, sampling: SamplingConfig = GREEDY,
                   prompt: list[int] = PROMPT) -> list[Collector]:
    collectors = [Collector() for _ in range(n)]
    for index, collector in enumerate(collectors):
        choice = sampling if sampling.seed is None else dataclasses.replace(
            sampling, seed=sampling.seed + index)
        worker.submit_generation(GenerationRequest(
            f"req-{index}", list(prompt), max_tokens, choice,
            fork_of=None if index == 0 else "req-0"), collector)
    return collectors


@pytest.mark.parametrize("cache", [False, True])
def test_followers_copy_the_prompt_instead_of_computing_it(stack, cache):
    worker, runtime = stack(cache=cache)
    collectors = submit_choices(worker, 4, max_tokens=6)
    results = [c.result() for c in collectors]
    assert all(len(r) == 6 for r in results)
    # Followers decode in lock-step, in one batch: identical shapes, identical tokens.
    assert results[1] == results[2] == results[3]
    assert runtime.computed["req-0"] == len(PROMPT) + 5
    for follower in ("req-1", "req-2", "req-3"):
        assert runtime.computed[follower] == 1 + 5, "only the last prompt token, then decode"
    assert sorted(dst for _, dst, _ in runtime.forks) == ["req-1", "req-2", "req-3"]
    assert all(count == len(PROMPT) - 1 for _, _, count in runtime.forks)
    assert runtime.active_session_count() == 0
    assert worker.stats().num_waiting == 0


def test_seeded_choices_are_reproducible_and_differ(stack):
    worker, _ = stack()
    sampling = SamplingConfig(temperature=1.5, seed=11, ignore_eos=True)
    first = [c.result() for c in submit_choices(worker, 3, 8, sampling)]
    second = [c.result() for c in submit_choices(worker, 3, 8, sampling)]
    assert first == second
    assert len({tuple(r) for r in first}) > 1


def test_followers_wait_for_a_lane_and_recompute_when_the_leader_is_gone(stack):
    """Two lanes, three choices and a one-token leader: the last follower gets a lane only
    after the leader finished, so it copies from a sibling; all complete, nothing leaks."""
    worker, runtime = stack(lanes=2)
    collectors = [Collector() for _ in range(3)]
    worker.submit_generation(GenerationRequest("req-0", list(PROMPT), 1, GREEDY), collectors[0])
    for index in (1, 2):
        worker.submit_generation(GenerationRequest(f"req-{index}", list(PROMPT), 4, GREEDY,
                                                   fork_of="req-0"), collectors[index])
    assert [len(c.result()) for c in collectors] == [1, 4, 4]
    assert runtime.computed["req-0"] == len(PROMPT)
    # The leader finished with its prefill: the first follower to get a lane computes the
    # prompt once more, the other copies it from that sibling.
    assert runtime.computed["req-1"] + runtime.computed["req-2"] == len(PROMPT) - 1 + 2 * 4
    assert runtime.active_session_count() == 0
    assert worker.stats().num_waiting == 0


def test_a_cancelled_leader_sets_its_waiting_followers_free(stack, blocked_worker):
    worker, runtime = stack(lanes=4)
    _, release = blocked_worker(worker)
    collectors = [Collector() for _ in range(3)]
    worker.submit_generation(GenerationRequest("req-0", list(PROMPT), 4, GREEDY), collectors[0])
    for index in (1, 2):
        worker.submit_generation(GenerationRequest(f"req-{index}", list(PROMPT), 4, GREEDY,
                                                   fork_of="req-0"), collectors[index])
    worker.cancel("req-0")  # drained with the submits: before the leader computed anything
    release.set()
    assert [len(c.result()) for c in collectors[1:]] == [4, 4]
    assert runtime.computed["req-0"] == 0
    assert runtime.computed["req-1"] == runtime.computed["req-2"] == len(PROMPT) + 3
    assert not runtime.forks
    assert isinstance(collectors[0].error, RequestCancelledError)  # answered at once
    assert runtime.active_session_count() == 0
    assert worker.stats().num_waiting == 0


def test_log_probabilities_reach_the_events(stack):
    worker, _ = stack()
    events = []
    done = Collector()

    def on_event(event):
        events.append(event)
        done(event)

    prompt = PROMPT[:20]
    sampling = SamplingConfig(temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    worker.submit_generation(GenerationRequest("lp", prompt, 3, sampling), on_event)
    done.result()
    prompt_entries = [e for ev in events if isinstance(ev, PromptLogprobsEvent)
                      for e in ev.entries]
    assert [position for position, _ in prompt_entries] == list(range(1, len(prompt)))
    assert [entry.token for _, entry in prompt_entries] == prompt[1:]
    token_events = [ev for ev in events if isinstance(ev, TokenEvent)]
    assert len(token_events) == 3
    assert all(ev.logprob is not None and ev.logprob.token == ev.token
               and len(ev.logprob.top) == 2 for ev in token_events)
