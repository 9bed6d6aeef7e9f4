"""Client disconnects and real sockets.

A client that leaves frees its lane. The first two tests drive the app through raw ASGI
so the disconnect happens at an exact point; the others run uvicorn on a real socket
(bound and listening before the server starts, so no readiness wait is needed),
including one with the official ``openai`` SDK as the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from skippyd.http.api.routes import create_app
from skippyd.http.parsing.request_params import HttpLimits

WAIT_S = 10.0
LIMITS = HttpLimits()
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def _chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


# -- disconnects -----------------------------------------------------------------------

def _http_scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }


async def _run_asgi(
    fake: Any, body: dict[str, Any], disconnected: asyncio.Event, on_send: Any = None
) -> list[dict[str, Any]]:
    """Drive the app through raw ASGI; the client disconnects once ``disconnected`` is set."""
    app = create_app(fake, limits=LIMITS)
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(sent)

    await asyncio.wait_for(app(_http_scope(CHAT_URL, raw), receive, send), WAIT_S)
    return sent


async def test_stream_disconnect_cancels_the_generation(fake: Any) -> None:
    fake.hold_after = 2
    disconnected = asyncio.Event()

    def after_two_tokens(sent: list[dict[str, Any]]) -> None:
        # The role chunk and the first tokens may share one write: count events.
        if sum(m.get("body", b"").count(b'"content": "') for m in sent) >= 3:
            disconnected.set()

    body = {**_chat("hi"), "stream": True}
    sent = await _run_asgi(fake, body, disconnected, after_two_tokens)
    generation = fake.only_generation()
    assert fake.cancel_calls == [generation.request.request_id]
    assert await asyncio.to_thread(generation.done.wait, WAIT_S)
    assert generation.outcome == "cancelled"
    assert not any(m.get("body") == b"data: [DONE]\n\n" for m in sent)


async def test_role_chunk_waits_for_the_first_token_and_keep_alives_fill_the_wait(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client timing the first chunk as the first token must not see it before the
    # prompt is processed; a long wait sends SSE comments instead.
    monkeypatch.setattr("skippyd.http.api.routes.KEEP_ALIVE_INTERVAL_S", 0.05)
    fake.hold_after = 0  # the prompt "takes forever": no token comes
    disconnected = asyncio.Event()

    def after_two_keep_alives(sent: list[dict[str, Any]]) -> None:
        if sum(m.get("body", b"").count(b": keep-alive\n\n") for m in sent) >= 2:
            disconnected.set()

    sent = await _run_asgi(fake, {**_chat("hi"), "stream": True}, disconnected,
                           after_two_keep_alives)
    bodies = b"".join(m.get("body", b"") for m in sent)
    assert bodies.count(b": keep-alive\n\n") >= 2
    assert b'"role"' not in bodies


async def test_role_chunk_goes_out_in_the_same_write_as_the_first_text(fake: Any) -> None:
    disconnected = asyncio.Event()
    sent = await _run_asgi(fake, {**_chat("hi"), "stream": True}, disconnected)
    bodies = [m["body"] for m in sent if m.get("body")]
    first = bodies[0].decode()
    events = [line for line in first.split("\n\n") if line.startswith("data: ")]
    assert len(events) >= 2, first
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant",
                                                                "content": ""}
    assert json.loads(events[1][6:])["choices"][0]["delta"]["content"]
    assert bodies[-1] == b"data: [DONE]\n\n"


async def test_non_streaming_disconnect_cancels_the_generation(fake: Any) -> None:
    fake.hold_after = 1
    disconnected = asyncio.Event()
    task = asyncio.create_task(_run_asgi(fake, _chat("hi"), disconnected))
    assert await asyncio.to_thread(fake.holding.wait, WAIT_S)
    # The app is parked waiting for the next token; now the client goes away.
    generation = fake.only_generation()
    assert fake.cancel_calls == []
    disconnected.set()
    await asyncio.wait_for(task, WAIT_S)
    assert fake.cancel_calls == [generation.request.request_id]
    assert await asyncio.to_thread(generation.done.wait, WAIT_S)
    assert generation.outcome == "cancelled"


# -- real sockets ----------------------------------------------------------------------

@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a listening socket bound before the server starts."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)
        sock.close()


async def test_real_socket_disconnect_frees_the_lane(fake: Any) -> None:
    fake.hold_after = 1
    async with serving(create_app(fake, limits=LIMITS)) as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=WAIT_S) as client:
            body = {**_chat("hi"), "stream": True}
            async with client.stream("POST", CHAT_URL, json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if '"content": "H' in line:
                        break
        generation = fake.only_generation()
        assert await asyncio.to_thread(generation.done.wait, WAIT_S)
    assert generation.outcome == "cancelled"
    assert fake.cancel_calls == [generation.request.request_id]


async def test_real_socket_round_trip(fake: Any) -> None:
    async with serving(create_app(fake, limits=LIMITS)) as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=WAIT_S) as client:
            response = await client.post(COMPLETIONS_URL, json={"prompt": "x", "stop": "wor"})
    assert response.json()["choices"][0]["text"] == "Hello "


async def test_openai_sdk_reads_our_shapes(fake: Any) -> None:
    openai = pytest.importorskip("openai")
    app = create_app(fake, api_key="k", limits=LIMITS)
    async with serving(app) as base_url:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True}, stop=["rld"],
        )]
        completion = await client.completions.create(model="any", prompt="x", max_tokens=5)
        fake.queue_full = True
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="any", prompt="x")
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello wo"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == fake.cached_tokens
    assert completion.choices[0].text == "Hello"
    assert completion.choices[0].finish_reason == "length"
