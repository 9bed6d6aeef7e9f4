"""The load generator: streaming ``/v1/completions`` requests against OpenAI endpoints.

One ``httpx.AsyncClient`` drives every request. Each level runs its requests closed loop
(``concurrency`` in flight) or on Poisson arrival times capped at ``concurrency`` in
flight; with two targets, each level runs on one target, then the other (back to back),
with the same prompts.

Times come from ``time.perf_counter``. TTFT is the time to the first chunk that carries
text (an SSE chunk with empty text does not count); inter-token latencies are the gaps
between text chunks. Output tokens come from the final usage chunk when the server sends
one (``stream_options.include_usage``), else from the number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx

from skippyd.bench.workload import DEFAULT_TIMEOUT_S, RequestSpec, WorkloadSpec, build_level

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
_ERROR_DETAIL_CHARS = 300


class BenchError(RuntimeError):
    """The benchmark cannot run (a target unreachable, rejecting requests, not starting)."""


class _StreamProtocolError(Exception):
    """The response stream is not the SSE shape of the OpenAI API."""


@dataclass(frozen=True, slots=True)
class Target:
    """One OpenAI-compatible endpoint under test."""

    name: str
    base_url: str
    """The API root, ending in ``/v1``."""
    model: str
    api_key: str | None = None
    send_usage_option: bool = True
    """Send ``stream_options.include_usage`` (dropped if the warm-up is refused with it)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds from its level's start."""

    index: int
    max_tokens: int
    num_prompt_words: int
    sent_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    """Send to first text chunk."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Send to each text chunk, in order."""
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    """``usage.prompt_tokens`` when the server reported it."""
    num_cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` when the server reported it."""
    token_source: Literal["usage", "chunks"] = "chunks"
    error: str | None = None
    """``http_<status>``, ``timeout``, ``connection``, ``protocol`` or ``stream_error``."""
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s


@dataclass(frozen=True, slots=True)
class LevelRun:
    """The records of one concurrency level on one target."""

    concurrency: int
    duration_s: float
    """Level start to the end of its last request."""
    records: tuple[RequestRecord, ...]


@dataclass(slots=True)
class TargetRun:
    """Everything measured on one target, level by level."""

    target: Target
    levels: list[LevelRun] = field(default_factory=list)


class ProgressHook:
    """Receives progress events; the default does nothing."""

    def level_started(self, target: Target, concurrency: int, num_requests: int) -> None:
        """A level starts on ``target``."""

    def request_done(self, record: RequestRecord) -> None:
        """A request of the current level ended (successfully or not)."""


def api_root(url: str) -> str:
    """Normalise a server URL: a bare ``http://host:port`` gets ``/v1`` appended."""
    url = url.rstrip("/")
    if httpx.URL(url).path in ("", "/"):
        url += "/v1"
    return url


def make_client(max_concurrency: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> httpx.AsyncClient:
    """The one HTTP client of a run, with a connection per stream (and a few spare)."""
    # NOTE: trust_env=False: a proxy from the environment must not sit between the
    # benchmark and the server.
    limits = httpx.Limits(max_connections=max_concurrency + 4,
                          max_keepalive_connections=max_concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=_CONNECT_TIMEOUT_S),
                             limits=limits, trust_env=False)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def resolve_target(client: httpx.AsyncClient, name: str, url: str, *,
                         model: str | None = None, api_key: str | None = None) -> Target:
    """Build a :class:`Target`, asking ``/v1/models`` for the model when none is given.

    Raises:
        BenchError: The endpoint is unreachable or lists no model.
    """
    root = api_root(url)
    if model is None:
        try:
            response = await client.get(f"{root}/models", headers=_headers(api_key))
        except httpx.TransportError as exc:
            raise BenchError(f"{name}: cannot reach {root} ({type(exc).__name__}: {exc})"
                             ) from exc
        try:
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise BenchError(f"{name}: cannot list models at {root}/models "
                             f"({type(exc).__name__}: {exc}); pass --model") from exc
    return Target(name=name, base_url=root, model=str(model), api_key=api_key)


def request_body(target: Target, request: RequestSpec, temperature: float) -> dict[str, Any]:
    """The JSON body of one streaming completion request."""
    body: dict[str, Any] = {
        "model": target.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
        "stream": True, "temperature": temperature,
        # NOTE: ignore_eos makes output lengths exact on skippyd and llama-server;
        # min_tokens does the same on llama_cpp.server. Servers ignore unknown fields.
        "ignore_eos": True, "min_tokens": request.max_tokens,
    }
    if target.send_usage_option:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_request(client: httpx.AsyncClient, target: Target, request: RequestSpec, *,
                       temperature: float, level_start: float,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> RequestRecord:
    """Send one streaming request and record its timings; never raises for its errors."""
    sent = time.perf_counter()
    record = RequestRecord(request.index, request.max_tokens, request.num_prompt_words,
                           sent_s=sent - level_start)
    body = request_body(target, request, temperature)
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, target, body, record, sent)
    except TimeoutError:
        _fail(record, "timeout", f"no complete response within {timeout_s:g} s")
    except httpx.TimeoutException as exc:
        _fail(record, "timeout", f"{type(exc).__name__}: {exc}")
    except httpx.TransportError as exc:
        _fail(record, "connection", f"{type(exc).__name__}: {exc}")
    except _StreamProtocolError as exc:
        _fail(record, "protocol", str(exc))
    record.end_s = time.perf_counter() - level_start
    if record.ok and record.token_source == "chunks":
        record.num_output_tokens = len(record.chunk_times_s)
    return record


def _fail(record: RequestRecord, kind: str, detail: str) -> None:
    if record.error is None:
        record.error, record.error_detail = kind, detail[:_ERROR_DETAIL_CHARS]


async def _stream(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                  record: RequestRecord, sent: float) -> None:
    url = f"{target.base_url}/completions"
    async with client.stream("POST", url, json=body, headers=_headers(target.api_key)) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", errors="replace")
            _fail(record, f"http_{response.status_code}", text)
            return
        async for line in response.aiter_lines():
            if _on_sse_line(line, record, time.perf_counter() - sent):
                return
    raise _StreamProtocolError("the stream ended without data: [DONE]")


def _on_sse_line(line: str, record: RequestRecord, elapsed_s: float) -> bool:
    """Account one SSE line; return True at ``[DONE]``."""
    if not line.startswith("data:"):
        return False  # blank separators, comments, event names, ids
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    try:
        payload = json.loads(data)
    except ValueError:
        raise _StreamProtocolError(f"an SSE event is not JSON: {data[:80]!r}") from None
    if not isinstance(payload, dict):
        raise _StreamProtocolError(f"an SSE event is not a JSON object: {data[:80]!r}")
    if "error" in payload:
        _fail(record, "stream_error", json.dumps(payload["error"]))
        return False
    if _chunk_text(payload):
        if record.ttft_s is None:
            record.ttft_s = elapsed_s
        record.chunk_times_s.append(elapsed_s)
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.num_output_tokens = usage["completion_tokens"]
        record.num_prompt_tokens = usage.get("prompt_tokens")
        record.token_source = "usage"
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.num_cached_tokens = details["cached_tokens"]
    return False


def _chunk_text(payload: dict[str, Any]) -> str:
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return text if isinstance(text, str) else ""


async def run_level(client: httpx.AsyncClient, target: Target, requests: Sequence[RequestSpec],
                    concurrency: int, *, temperature: float, timeout_s: float,
                    on_done: Callable[[RequestRecord], None]) -> LevelRun:
    """Run one level: at most ``concurrency`` requests in flight, each sent no earlier
    than its arrival offset."""
    slots = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(request: RequestSpec) -> RequestRecord:
        delay_s = start + request.arrival_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)  # the Poisson schedule, not a wait for an event
        async with slots:
            record = await send_request(client, target, request, temperature=temperature,
                                        level_start=start, timeout_s=timeout_s)
        on_done(record)
        return record

    records = await asyncio.gather(*(one(request) for request in requests))
    duration_s = max(record.end_s for record in records)
    return LevelRun(concurrency, duration_s, tuple(records))


async def warm_up(client: httpx.AsyncClient, target: Target, spec: WorkloadSpec,
                  timeout_s: float) -> Target:
    """Send one short uncounted request; drop the usage option if the server refuses it.

    Raises:
        BenchError: The target fails the warm-up request either way.
    """
    request = RequestSpec(index=-1, prompt="warm up the model with a short prompt",
                          num_prompt_words=7, max_tokens=4, arrival_s=0.0)
    for attempt in (target, replace(target, send_usage_option=False)):
        record = await send_request(client, attempt, request, temperature=spec.temperature,
                                    level_start=time.perf_counter(), timeout_s=timeout_s)
        if record.ok:
            return attempt
        logger.info("%s: warm-up failed (%s: %s)", target.name, record.error, record.error_detail)
    raise BenchError(f"{target.name}: the warm-up request to {target.base_url}/completions "
                     f"failed: {record.error}: {record.error_detail}")


async def measure_urls(spec: WorkloadSpec, urls: Sequence[tuple[str, str]], *,
                       progress: ProgressHook | None = None) -> list[TargetRun]:
    """Run ``spec`` on each ``(name, url)`` with one shared client (the bench scripts)."""
    async with make_client(max(spec.concurrency)) as client:
        targets = [await resolve_target(client, name, url) for name, url in urls]
        return await run_benchmark(client, targets, spec, progress=progress)


async def run_benchmark(client: httpx.AsyncClient, targets: Sequence[Target],
                        spec: WorkloadSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                        progress: ProgressHook | None = None) -> list[TargetRun]:
    """Warm every target up, then run each level on each target in turn.

    The order alternates from level to level (the first target first at the first
    level, the last target first at the second, ...), so a host whose speed drifts does
    not favour one target at every level; repeating a concurrency (``-c 8,8,8,8``)
    measures it in both orders.

    Raises:
        BenchError: A target fails its warm-up.
    """
    hook = progress or ProgressHook()
    runs = [TargetRun(await warm_up(client, target, spec, timeout_s)) for target in targets]
    for level_index, concurrency in enumerate(spec.concurrency):
        requests = build_level(spec, level_index)
        for run in runs if level_index % 2 == 0 else runs[::-1]:
            hook.level_started(run.target, concurrency, len(requests))
            level = await run_level(client, run.target, requests, concurrency,
                                    temperature=spec.temperature, timeout_s=timeout_s,
                                    on_done=hook.request_done)
            logger.info("%s c=%d: %.2f s", run.target.name, concurrency, level.duration_s)
            run.levels.append(level)
    return runs
