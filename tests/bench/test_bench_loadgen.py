"""The load generator against a scripted OpenAI-style server on a real loopback socket.

The server is bound and listening before uvicorn starts, so no readiness wait is
needed. The requested model name picks the server's behaviour, so each test scripts
exactly the stream it needs: an empty first chunk, a usage chunk, an HTTP error, a
stream cut short, an error event, a stream that never ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from skippyd.bench.loadgen import (
    BenchError,
    ProgressHook,
    Target,
    api_root,
    make_client,
    resolve_target,
    run_benchmark,
    run_level,
    send_request,
    warm_up,
)
from skippyd.bench.report import level_metrics
from skippyd.bench.workload import IntRange, RequestSpec, WorkloadSpec, build_level

TEXT_DELAY_S = 0.2
SPEC = WorkloadSpec(concurrency=(2,), num_requests=5, prompt_words=IntRange(4, 8),
                    output_tokens=IntRange(3, 3))


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _text(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


async def _script(model: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    if model == "hang":
        await asyncio.Event().wait()
    if model == "error-event":
        yield _event({"error": {"message": "worker failed", "code": "internal"}})
        yield b"data: [DONE]\n\n"
        return
    yield _text("")  # an empty chunk: must not count as the first token
    await asyncio.sleep(TEXT_DELAY_S if model == "slow-text" else 0)
    for _ in range(body["max_tokens"]):
        yield _text("word ")
    if model == "no-done":
        return
    if body.get("stream_options", {}).get("include_usage"):
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": 42,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        yield _event({"choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


async def _completions(request: Request) -> Response:
    body = await request.json()
    model = body["model"]
    if model == "http-503":
        return JSONResponse({"error": {"message": "loading"}}, status_code=503)
    if model == "strict" and "stream_options" in body:
        return JSONResponse({"error": {"message": "stream_options unknown"}}, status_code=400)
    return StreamingResponse(_script(model, body), media_type="text/event-stream")


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})


APP = Starlette(routes=[Route("/v1/models", _models), Route("/v1/completions", _completions,
                                                                methods=["POST"])])


@contextlib.asynccontextmanager
async def serve_scripted() -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(APP, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


async def _send(url: str, model: str, *, max_tokens: int = 3, timeout_s: float = 10.0,
                usage: bool = True):
    target = Target("t", api_root(url), model, send_usage_option=usage)
    request = RequestSpec(0, "one two three", 3, max_tokens, 0.0)
    async with make_client(1, timeout_s) as client:
        return await send_request(client, target, request, temperature=0.0,
                                  level_start=0.0, timeout_s=timeout_s)


async def test_ttft_waits_for_the_first_chunk_with_text():
    async with serve_scripted() as url:
        record = await _send(url, "slow-text", max_tokens=4, usage=False)
    assert record.ok, record.error_detail
    assert record.ttft_s is not None and record.ttft_s >= TEXT_DELAY_S
    assert len(record.chunk_times_s) == 4
    assert record.num_output_tokens == 4 and record.token_source == "chunks"
    assert record.num_prompt_tokens is None


async def test_usage_chunk_gives_the_token_counts():
    async with serve_scripted() as url:
        record = await _send(url, "plain", max_tokens=2)
    assert record.ok, record.error_detail
    assert (record.num_output_tokens, record.num_prompt_tokens) == (42, 3)
    assert record.num_cached_tokens == 2
    assert record.token_source == "usage"


@pytest.mark.parametrize(("model", "kind"), [
    ("http-503", "http_503"), ("no-done", "protocol"), ("error-event", "stream_error"),
    ("hang", "timeout"),
])
async def test_errors_are_classified_by_kind(model, kind):
    async with serve_scripted() as url:
        record = await _send(url, model, timeout_s=0.5)
    assert record.error == kind
    assert record.error_detail


async def test_unreachable_server_is_a_connection_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        record = await _send(f"http://127.0.0.1:{port}", "plain")
        async with make_client(1) as client:
            with pytest.raises(BenchError, match="cannot reach"):
                await resolve_target(client, "t", f"http://127.0.0.1:{port}")
    assert record.error == "connection"


async def test_warm_up_drops_the_usage_option_a_server_refuses():
    async with serve_scripted() as url, make_client(1) as client:
        target = await resolve_target(client, "t", url)
        assert target.model == "scripted" and target.base_url == f"{url}/v1"
        strict = await warm_up(client, Target("t", f"{url}/v1", "strict"), SPEC, 10.0)
        with pytest.raises(BenchError, match="http_503"):
            await warm_up(client, Target("t", f"{url}/v1", "http-503"), SPEC, 10.0)
    assert target.send_usage_option and not strict.send_usage_option


async def test_level_runs_every_request_with_at_most_concurrency_in_flight():
    requests = build_level(SPEC, 0)
    done = []
    async with serve_scripted() as url, make_client(2) as client:
        target = Target("t", f"{url}/v1", "slow-text", send_usage_option=False)
        level = await run_level(client, target, requests, 2, temperature=0.0,
                                timeout_s=10.0, on_done=done.append)
    assert sorted(r.index for r in level.records) == list(range(SPEC.num_requests))
    assert len(done) == SPEC.num_requests
    # Each request lasts >= TEXT_DELAY_S; 5 requests two at a time need 3 rounds.
    assert level.duration_s >= 3 * TEXT_DELAY_S
    starts = sorted(r.sent_s for r in level.records)
    assert starts[2] >= min(r.end_s for r in level.records) - 1e-3
    metrics = level_metrics(level)
    assert metrics.num_ok == SPEC.num_requests and metrics.errors == {}
    assert metrics.output_tokens == 3 * SPEC.num_requests
    assert metrics.prompt_tokens_source == "words" and metrics.cached_prompt_tokens is None
    assert metrics.prompt_tokens == sum(r.num_prompt_words for r in requests)


async def test_two_targets_take_turns_going_first_from_level_to_level():
    class Order(ProgressHook):
        def __init__(self) -> None:
            self.started: list[tuple[str, int]] = []

        def level_started(self, target: Target, concurrency: int, num_requests: int) -> None:
            self.started.append((target.name, concurrency))

    spec = WorkloadSpec(concurrency=(1, 2, 2), num_requests=2, prompt_words=IntRange(4, 4),
                        output_tokens=IntRange(2, 2))
    order = Order()
    async with serve_scripted() as url, make_client(2) as client:
        targets = [Target(name, f"{url}/v1", "scripted") for name in ("first", "second")]
        runs = await run_benchmark(client, targets, spec, timeout_s=10.0, progress=order)
    assert order.started == [("first", 1), ("second", 1), ("second", 2), ("first", 2),
                             ("first", 2), ("second", 2)]
    # The report keeps the targets' order, each with its levels in the spec's order.
    assert [run.target.name for run in runs] == ["first", "second"]
    assert all(len(run.levels) == 3 for run in runs)
