"""Every stage of a split pipeline can be scraped, and the Grafana dashboard only asks for
metrics a real pipeline exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from link_support import STAGE_READY, free_port, tiny_stage, wait_until
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess

from skippyd import __version__

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "skippyd.json"
METRIC_NAME = re.compile(r"\b((?:skippyd|process|python)_[a-z0-9_]+)\b")


def scrape(url: str) -> dict[str, list]:
    """Sample name -> samples of one /metrics page."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_model_path):
    """Stages 0 and 1 of the tiny model, each with a metrics listener; one request run."""
    workdir = tmp_path_factory.mktemp("metrics-chain")
    link_ports, metrics_ports = [free_port(), free_port()], [free_port(), free_port()]
    procs = []
    try:
        for index, layers in ((1, (2, 4)), (0, (0, 2))):
            directory = workdir / f"s{index}"
            directory.mkdir()
            config = tiny_stage(tiny_model_path, workdir, index=index, layers=layers,
                                n_batch=128, ports=link_ports)
            config += f'[telemetry]\nmetrics_listen = "127.0.0.1:{metrics_ports[index]}"\n'
            procs.append(ServeProcess(config, directory))
        later, head = procs
        later.wait_for_line(STAGE_READY, timeout=60)
        head.wait_ready()
        wait_until(lambda: httpx.get(head.base_url + "/health", timeout=10).json()["status"]
                   == "ok", 30, "the pipeline to connect")
        response = httpx.post(head.url + "/completions", timeout=60, json={
            "prompt": "the cat", "max_tokens": 6, "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200, response.text
        yield head, later, [f"http://127.0.0.1:{port}" for port in metrics_ports]
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_later_stage_serves_metrics_and_health_without_an_api(pipeline):
    head, later, listeners = pipeline
    health = httpx.get(listeners[1] + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(listeners[1] + "/v1/models", timeout=10).status_code == 404
    samples = scrape(listeners[1] + "/metrics")
    (info,) = samples["skippyd_build_info"]
    assert info.labels == {"version": __version__, "model": "tiny", "stage": "tiny-1",
                           "stage_index": "1", "layer_start": "2", "layer_end": "4"}
    traffic = {(s.labels["peer"], s.labels["direction"]): s.value
               for s in samples["skippyd_link_bytes_total"]}
    assert traffic[("upstream", "in")] > 0 and traffic[("upstream", "out")] > 0
    assert samples["skippyd_link_batches_total"][0].value > 0
    assert samples["skippyd_direct_iterations_total"][0].value > 0
    assert samples["process_resident_memory_bytes"][0].value > 0


def test_stage_zero_serves_the_same_page_on_its_api_and_its_listener(pipeline):
    head, _later, listeners = pipeline
    api, listener = scrape(head.base_url + "/metrics"), scrape(listeners[0] + "/metrics")
    assert set(api) == set(listener)
    (info,) = listener["skippyd_build_info"]
    assert (info.labels["stage"], info.labels["layer_start"], info.labels["layer_end"]) == \
        ("tiny-0", "0", "2")
    traffic = {(s.labels["peer"], s.labels["direction"]): s.value
               for s in listener["skippyd_link_bytes_total"]}
    assert traffic[("downstream", "out")] > 0 and traffic[("downstream", "in")] > 0
    assert listener["skippyd_link_up"][0].value == 1
    assert listener["skippyd_generation_tokens_total"][0].value >= 6


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    exprs += [variable.get("query", "") if isinstance(variable.get("query"), str)
              else variable["query"].get("query", "")
              for variable in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


def test_the_grafana_dashboard_asks_only_for_exported_metrics(pipeline):
    head, _later, listeners = pipeline
    exported: set[str] = set()
    for url in (head.base_url + "/metrics", *(listener + "/metrics" for listener in listeners)):
        exported |= set(scrape(url))
    wanted = dashboard_metrics()
    assert len(wanted) >= 15
    assert wanted <= exported, f"not exported: {sorted(wanted - exported)}"


def test_the_dashboard_covers_what_an_operator_watches():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "ttft", "inter-token", "queue", "kv", "prefix cache", "link"):
        assert topic in titles, f"no panel about {topic}: {titles}"
    wanted = dashboard_metrics()
    for name in ("skippyd_time_to_first_token_seconds_bucket",
                 "skippyd_inter_token_latency_seconds_bucket", "skippyd_link_bytes_total",
                 "skippyd_prefix_cache_hits_total", "skippyd_prefix_cache_queries_total",
                 "skippyd_kv_cache_usage_ratio", "skippyd_requests_waiting"):
        assert name in wanted
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel}
    assert uids == {"${datasource}"}
