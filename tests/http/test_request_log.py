"""The per-request log line and the Prometheus families beyond the request windows."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skippyd import __version__
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    TokenAck,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import (
    AdmissionTimeoutError,
    QueueFullError,
    WorkerBackendError,
)
from skippyd.http.observability.metrics import ServingMetrics
from skippyd.http.observability.request_log import RequestLog, format_request_line, request_fields
from skippyd.logs import JsonFormatter

LOGGER = "skippyd.http.observability.request_log"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def token() -> TokenEvent:
    return TokenEvent(7, TokenAck())


def logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == LOGGER]


def run_request(metrics: ServingMetrics, clock: FakeClock, req_id: str = "cmpl-1",
                cached_tokens: int = 0) -> None:
    timer = metrics.start_request(req_id, 57)
    clock.now += 0.05  # 50 ms in the queue
    timer.on_event(AdmittedEvent(cached_tokens))
    clock.now += 0.2  # TTFT 250 ms
    timer.on_event(token())
    for _ in range(10):  # then 10 tokens in 0.5 s: 20 tok/s
        clock.now += 0.05
        timer.on_event(token())
    timer.on_event(CompleteEvent("length"))


def test_a_finished_request_logs_one_line_with_its_figures(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock, request_log=RequestLog())
    run_request(metrics, clock, cached_tokens=32)
    (record,) = logged(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "request cmpl-1: 200 length, prompt 57 tok (cached 32), generated 11 tok,"
        " queue 50 ms, ttft 250 ms, decode 20 tok/s, total 750 ms")
    assert record.fields["decode_tok_s"] == pytest.approx(20.0)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "cmpl-1" and line["status"] == 200
    assert line["cached_tokens"] == 32 and line["queue_ms"] == 50.0
    assert line["level"] == "info" and line["message"].startswith("request cmpl-1: 200")


def test_a_speculating_request_logs_its_drafts(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    metrics = ServingMetrics(clock=FakeClock(), request_log=RequestLog())
    timer = metrics.start_request("r", 4)
    timer.on_event(CompleteEvent("stop", drafted=12, accepted=9))
    (record,) = logged(caplog)
    assert record.getMessage().endswith(", drafts 9/12 accepted")
    assert (record.fields["drafted_tokens"], record.fields["accepted_tokens"]) == (12, 9)


def test_a_request_that_ends_before_its_admission_logs_no_queue_time(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock, request_log=RequestLog())
    timer = metrics.start_request("cmpl-q", 5)
    clock.now += 1.0
    timer.on_event(ErrorEvent(AdmissionTimeoutError("waited too long")))
    (record,) = logged(caplog)  # written at once: nothing else is waited for
    assert record.fields["queue_ms"] is None and "queue -," in record.getMessage()


def test_failures_cancellations_and_rejections_log_their_status(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    metrics = ServingMetrics(clock=FakeClock(), request_log=RequestLog())
    metrics.start_request("full", 3).on_event(ErrorEvent(QueueFullError()))
    metrics.start_request("broken", 3).on_event(ErrorEvent(WorkerBackendError("boom")))
    metrics.start_request("gone", 3).on_cancelled()
    statuses = {r.fields["request_id"]: (r.fields["status"], r.fields["finish_reason"])
                for r in logged(caplog)}
    assert statuses == {"full": (429, "rejected"), "broken": (500, "failed"),
                        "gone": (499, "cancelled")}


def test_switched_off_it_logs_nothing(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock, request_log=RequestLog(enabled=False))
    run_request(metrics, clock)
    assert logged(caplog) == []


def test_the_line_never_carries_prompt_text():
    metrics = ServingMetrics(clock=FakeClock())
    timer = metrics.start_request("r", 4)
    timer.on_cancelled()
    fields = request_fields(timer)
    assert set(fields) == {"request_id", "status", "finish_reason", "prompt_tokens",
                           "cached_tokens", "generated_tokens", "queue_ms", "ttft_ms",
                           "decode_tok_s", "total_ms", "drafted_tokens", "accepted_tokens"}
    assert "ttft -" in format_request_line(fields)


def families(metrics: ServingMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_build_info_process_collectors_buckets_and_prefix_tokens():
    prefix = {"hits": 3, "misses": 1, "matched_tokens": 300, "queried_tokens": 520,
              "evictions": 2, "bytes_resident": 4096, "bytes_host": 0}
    metrics = ServingMetrics(prefix_cache_stats=lambda: prefix, build_info={
        "version": __version__, "model": "m", "stage": "stage-0", "stage_index": 0,
        "layer_start": 0, "layer_end": 30})
    timer = metrics.start_request("slow", 4)
    metrics.clock = lambda: timer.submitted_at + 1000.0  # a 1000 s CPU generation
    timer.on_event(token())
    timer.on_event(CompleteEvent("stop"))
    found = families(metrics)
    (info,) = found["skippyd_build_info"].samples
    assert info.labels == {"version": __version__, "model": "m", "stage": "stage-0",
                           "stage_index": "0", "layer_start": "0", "layer_end": "30"}
    assert info.value == 1
    assert "process_resident_memory_bytes" in found and "python_info" in found
    assert "python_gc_objects_collected" in found
    counters = {name: found[name].samples[0].value for name in (
        "skippyd_prefix_cache_queries", "skippyd_prefix_cache_hits",
        "skippyd_prefix_cache_lookups", "skippyd_prefix_cache_lookup_hits")}
    assert counters == {"skippyd_prefix_cache_queries": 520, "skippyd_prefix_cache_hits": 300,
                        "skippyd_prefix_cache_lookups": 4,
                        "skippyd_prefix_cache_lookup_hits": 3}
    e2e = {s.labels["le"]: s.value for s in found["skippyd_e2e_request_latency_seconds"].samples
           if s.name.endswith("_bucket")}
    assert e2e["640.0"] == 0 and e2e["1280.0"] == 1  # not lumped into +Inf
    assert "skippyd_link_bytes" not in found  # a whole-model stage has no link


def test_link_traffic_of_a_split_stage():
    link = {"bytes_in": 10, "bytes_out": 20, "batches": 3, "connections": 1, "rejected": 0,
            "busy_s": 1.5, "active_sessions": 2,
            "chain": {"up": True, "bytes_out": 700, "bytes_in": 90}}
    found = families(ServingMetrics(link_status=lambda: link))
    traffic = {(s.labels["peer"], s.labels["direction"]): s.value
               for s in found["skippyd_link_bytes"].samples if s.name.endswith("_total")}
    assert traffic == {("upstream", "in"): 10, ("upstream", "out"): 20,
                       ("downstream", "out"): 700, ("downstream", "in"): 90}
    assert found["skippyd_link_up"].samples[0].value == 1
    assert found["skippyd_link_busy_seconds"].samples[0].value == 1.5
