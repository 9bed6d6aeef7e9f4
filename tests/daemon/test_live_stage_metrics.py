"""A real stage on the tiny model: HTTP requests move /metrics and the control snapshot.

The app is assembled here the way the daemon does it (StageEngine + create_app with the
metrics route) and served by uvicorn on a socket bound before it starts; the control
socket serves snapshots of the same engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from skippyd.config import parse_config
from skippyd.control.client import AsyncControlClient
from skippyd.control.server import ControlServer
from skippyd.daemon.assembly import StageEngine
from skippyd.daemon.snapshot import snapshot_source
from skippyd.engine.worker.worker_errors import QueueFullError
from skippyd.exitcodes import ExitCode
from skippyd.http.api.routes import create_app
from skippyd.http.observability.metrics import ServingMetrics, metrics_route
from skippyd.tui.status import run_status

WAIT_S = 30.0
LANES = 4
CTX = 512


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a socket that listens before the server starts."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)
        sock.close()


@dataclass
class Stage:
    url: str
    metrics: ServingMetrics
    engine: StageEngine
    control_path: Path


@pytest.fixture
async def stage(tiny_model_path: Path) -> AsyncIterator[Stage]:
    run_dir = Path(tempfile.mkdtemp(prefix="skl"))
    config = parse_config({"stage": {"id": "tiny", "model_path": str(tiny_model_path)},
                           "runtime": {"ctx_size": CTX, "lane_count": LANES, "threads": 1}})
    engine = StageEngine(config)
    await asyncio.to_thread(engine.load)
    metrics = ServingMetrics.for_engine(engine)
    metrics.attach(engine.telemetry)
    control = ControlServer(run_dir / "tiny.sock", stage_id="tiny",
                            snapshot=snapshot_source(engine, metrics),
                            telemetry=engine.telemetry)
    await control.start()
    app = create_app(engine, extra_routes=[metrics_route(metrics)], metrics=metrics)
    try:
        async with serving(app) as url:
            yield Stage(url, metrics, engine, control.path)
    finally:
        await control.close()
        metrics.detach()
        await asyncio.to_thread(engine.close)
        shutil.rmtree(run_dir, ignore_errors=True)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        # Ours, plus prometheus_client's standard process and Python collectors.
        assert family.name.startswith(("skippyd_", "process_", "python_")), family.name
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def get_metrics(client: httpx.AsyncClient) -> dict[Any, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return scrape(response.text)


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def worker_settled(stage: Stage, finished: int) -> None:
    """Wait until the worker's published stats show it idle with ``finished`` sequences
    done: it publishes them when it goes idle, which can come just after the last
    response reached its client."""
    async def poll() -> None:
        while True:
            stats = stage.engine.worker.stats()
            if (stats.num_active, stats.num_waiting) == (0, 0) and (
                    stats.num_finished >= finished):
                return
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), WAIT_S)


async def stream_chat(client: httpx.AsyncClient) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    usage, finish = None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    assert usage is not None and finish is not None
    return {"usage": usage, "choices": [{"finish_reason": finish}]}


async def test_requests_move_metrics_and_the_snapshot(stage: Stage) -> None:
    async with httpx.AsyncClient(base_url=stage.url, timeout=WAIT_S) as client:
        before = await get_metrics(client)
        body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0}
        posts = [client.post("/v1/completions", json={**body, "prompt": f"the cat {i}"})
                 for i in range(5)]
        responses = await asyncio.gather(*posts, stream_chat(client))
        bodies = [r if isinstance(r, dict) else r.json() for r in responses]
        await worker_settled(stage, finished=len(bodies))
        after = await get_metrics(client)
    num = len(bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    with_tokens = sum(b["usage"]["completion_tokens"] > 0 for b in bodies)
    reasons = Counter(b["choices"][0]["finish_reason"] for b in bodies)
    assert delta(before, after, "skippyd_prompt_tokens_total") == prompt
    assert delta(before, after, "skippyd_generation_tokens_total") == generated > 0
    for reason, count in reasons.items():
        assert delta(before, after, "skippyd_requests_total", outcome=reason) == count
    assert delta(before, after, "skippyd_time_to_first_token_seconds_count") == with_tokens
    assert delta(before, after, "skippyd_inter_token_latency_seconds_count") == (
        generated - with_tokens)
    assert delta(before, after, "skippyd_e2e_request_latency_seconds_count") == num
    assert delta(before, after, "skippyd_request_queue_time_seconds_count") == num
    assert delta(before, after, "skippyd_iteration_step_seconds_count") > 0
    assert delta(before, after, "skippyd_iterations_total") > 0
    assert delta(before, after, "skippyd_prefix_cache_queries_total") >= 0
    assert after[("skippyd_requests_running", ())] == 0
    assert after[("skippyd_requests_waiting", ())] == 0
    assert 0.0 <= after[("skippyd_kv_cache_usage_ratio", ())] <= 1.0

    async with await AsyncControlClient.connect(stage.control_path) as control:
        snapshot = await control.status()
    assert snapshot["stage"] == {"id": "tiny", "index": 0, "model": stage.engine.model_id,
                                 "layer_start": 0, "layer_end": 4, "is_first": True,
                                 "is_final": True,
                                 "offload": {"gpu_layers": 0, "main_gpu": 0, "tensor_split": [],
                                             "gpu_backend": False}}
    assert snapshot["health"] == {"status": "ok", "reason": None}
    assert snapshot["lane_count"] == LANES
    assert [lane["lane"] for lane in snapshot["lanes"]] == list(range(LANES))
    counters = snapshot["counters"]
    assert (counters["finished"], counters["failed"], counters["rejected"]) == (num, 0, 0)
    assert (counters["prompt_tokens"], counters["generation_tokens"]) == (prompt, generated)
    assert counters["iterations"] == after[("skippyd_iterations_total", ())]
    assert snapshot["latency_ms"]["ttft"]["count"] == with_tokens
    assert snapshot["latency_ms"]["e2e"]["p50"] > 0
    assert snapshot["throughput"]["generation_tok_s"] > 0
    assert snapshot["kv"]["cells_total"] >= CTX
    json.dumps(snapshot, allow_nan=False)  # plain JSON, no NaN

    console = Console(record=True, width=120)
    code = await asyncio.to_thread(run_status, stage.control_path, None, False, out=console)
    text = console.export_text()
    assert code == ExitCode.OK
    assert "stage tiny" in text and "health ok" in text
    assert f"finished {num}" in text


async def test_status_json_and_unreachable_socket(stage: Stage,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(run_status, stage.control_path, None, True)
    assert code == ExitCode.OK
    printed = json.loads(capsys.readouterr().out)
    assert printed["stage"]["id"] == "tiny" and printed["health"]["status"] == "ok"
    missing = stage.control_path.with_name("nobody.sock")
    assert await asyncio.to_thread(run_status, missing, None, True) == ExitCode.UNREACHABLE
    assert "cannot connect" in capsys.readouterr().err


class FullBackend:
    """A backend whose queue is always full."""

    model_id, ctx_size, n_vocab = "full", 64, 300
    max_context_tokens, local_sampling = 64, True

    def health(self) -> tuple[str, str | None]:
        return "ok", None

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return [5] * len(text)

    def submit(self, request: Any, on_event: Any) -> None:
        raise QueueFullError()

    def detokenizer(self) -> Any:
        return None

    def cancel(self, request_id: str) -> None:
        pass

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


async def test_refused_requests_are_counted_by_reason() -> None:
    metrics = ServingMetrics()
    app = create_app(FullBackend(), api_key="sesame",  # type: ignore[arg-type]
                     extra_routes=[metrics_route(metrics)], metrics=metrics)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        body = {"prompt": "hi", "max_tokens": 4}
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        keyed = {"Authorization": "Bearer sesame"}
        refused = await client.post("/v1/completions", json=body, headers=keyed)
        assert refused.status_code == 429 and "retry-after" in refused.headers
        page = await client.get("/metrics", headers=keyed)
    samples = scrape(page.text)
    assert samples[("skippyd_requests_rejected_total", (("reason", "unauthorized"),))] == 1
    assert samples[("skippyd_requests_rejected_total", (("reason", "queue_full"),))] == 1
    assert metrics.outcomes == {"finished": 0, "failed": 0, "cancelled": 0}
