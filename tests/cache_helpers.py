"""Helpers of the prefix-cache tests: tiny-model runtimes, greedy runs, collectors."""

from __future__ import annotations

import threading

from skippyd.engine.prefix_cache import PrefixCacheSettings
from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import WorkerError

#: Greedy, and never stopping early: every generation has its full length.
GREEDY = SamplingConfig(temperature=0.0, ignore_eos=True)
N_BATCH = 256
N_UBATCH = 64
WAIT_S = 30.0
#: Small thresholds so short test prompts are worth caching.
SETTINGS = PrefixCacheSettings(max_entries=8, min_tokens=16, shared_prefix_stride_tokens=32,
                               host_ram_bytes=64 << 20)


def tokens(seed: int, count: int) -> list[int]:
    """``count`` deterministic token ids of the tiny vocabulary (no control tokens)."""
    return [3 + (seed * 31 + i * 7) % 290 for i in range(count)]


def tiny_options(path, *, lanes: int = 4, ctx_size: int = 2048) -> RuntimeOptions:
    """A tiny-model runtime's options; each lane holds ``ctx_size / lanes`` tokens."""
    return RuntimeOptions(str(path), lane_count=lanes, ctx_size=ctx_size,
                          n_batch=N_BATCH, n_ubatch=N_UBATCH, threads=1)


def open_runtime(path, *, lanes: int = 4, ctx_size: int = 2048) -> LlamaRuntime:
    """A tiny-model runtime (:func:`tiny_options`)."""
    return LlamaRuntime(tiny_options(path, lanes=lanes, ctx_size=ctx_size))


def greedy_continue(runtime: LlamaRuntime, session: str, suffix: list[int], count: int) -> list[int]:
    """Prefill ``suffix`` in one call after what the session holds, then decode greedily."""
    request = IterationRequest(session, suffix, sampling=GREEDY, sample_last=True)
    generated: list[int] = []
    while len(generated) < count:
        generated.append(runtime.run_iteration([request]).samples[0].token)
        request = IterationRequest(session, [generated[-1]], sampling=GREEDY, sample_last=True,
                                   phase=RowPhase.DECODE)
    return generated


def prefill(runtime: LlamaRuntime, session: str, prompt: list[int]) -> None:
    """Compute ``prompt`` into the session in one call, without sampling."""
    runtime.run_iteration([IterationRequest(session, prompt)])


class Collector:
    """An ``on_event`` callback that answers every token with Continue and keeps them.

    ``cached_tokens`` is what the admission event said was restored from the prefix cache
    (None until the request is admitted).
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: WorkerError | None = None
        self.done = threading.Event()

    def __call__(self, event: GenerationEvent) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
            event.ack.send(TokenControl.CONTINUE)
        elif isinstance(event, AdmittedEvent):
            self.cached_tokens = event.cached_tokens
        elif isinstance(event, CompleteEvent):
            self.finish_reason = event.finish_reason
            self.done.set()
        elif isinstance(event, ErrorEvent):
            self.error = event.error
            self.done.set()

    def result(self, timeout_s: float = WAIT_S) -> list[int]:
        """The generated tokens once complete; raises the generation's error."""
        assert self.done.wait(timeout_s), "the generation did not finish in time"
        if self.error is not None:
            raise self.error
        return self.tokens


def submit_all(worker, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, Collector]:
    """Queue every prompt at once (no waiting in between) and return their collectors."""
    collectors = {}
    for req_id, prompt in prompts.items():
        collectors[req_id] = Collector()
        worker.submit_generation(
            GenerationRequest(req_id, list(prompt), max_tokens, GREEDY), collectors[req_id])
    return collectors
