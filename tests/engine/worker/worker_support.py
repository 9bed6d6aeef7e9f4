"""Driving a worker handle from a test: barriers, runtime probes and whole generations.

The handle never blocks on the worker; these helpers wait on events with timeouts, the
way the HTTP layer waits on its callbacks.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fake_runtime import EventRecorder

from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.handle import GenerationHandle, WorkerHandle

WAIT_S = 10.0


def on_worker(worker: WorkerHandle, fn: Callable[[Any], Any], timeout_s: float = WAIT_S) -> Any:
    """Run ``fn(runtime)`` on the worker thread, after every command queued before it.

    Returns what ``fn`` returned; re-raises what it raised.
    """
    done = threading.Event()
    result: dict[str, Any] = {}

    def run(runtime: Any) -> None:
        try:
            result["value"] = fn(runtime)
        except BaseException as exc:
            result["error"] = exc
        finally:
            done.set()

    worker.execute_runtime_detached("test-probe", run)
    assert done.wait(timeout_s), "the worker never reached the probe"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def barrier(worker: WorkerHandle) -> None:
    """Return once the worker has run every command queued before this call."""
    on_worker(worker, lambda _runtime: None)


@dataclass(frozen=True)
class Generated:
    """What a generation produced, as a client sees it."""

    tokens: list[int]
    finish_reason: str
    drafted: int = 0
    """Drafted tokens verified (speculative decoding)."""
    accepted: int = 0


def generate(
    worker: GenerationHandle,
    prompt_tokens: Sequence[int],
    max_tokens: int,
    *,
    request_id: str | None = None,
    sampling: SamplingConfig | None = None,
    on_token: Callable[[int], TokenControl] | None = None,
    speculative: bool = True,
) -> Generated:
    """Submit a generation and answer its token events until it ends.

    ``on_token`` decides each answer (Continue by default). Tokens still in flight after a
    Stop are answered with Stop and left out, as the HTTP layer does.

    Raises:
        WorkerError: The generation ended with an error event.
    """
    recorder = EventRecorder()
    request = GenerationRequest(request_id or uuid.uuid4().hex, list(prompt_tokens),
                                max_tokens, sampling, speculative=speculative)
    worker.submit_generation(request, recorder)
    tokens: list[int] = []
    stopped = False
    while True:
        event = recorder.next(WAIT_S)
        if isinstance(event, TokenEvent):
            if stopped:
                event.ack.send(TokenControl.STOP)
                continue
            tokens.append(event.token)
            control = on_token(event.token) if on_token is not None else TokenControl.CONTINUE
            event.ack.send(control)
            stopped = control is TokenControl.STOP
        elif isinstance(event, AdmittedEvent | PromptLogprobsEvent):
            continue
        elif isinstance(event, CompleteEvent):
            return Generated(tokens, "stop" if stopped else event.finish_reason,
                             event.drafted, event.accepted)
        else:
            raise event.error
