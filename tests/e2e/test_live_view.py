"""The live view of a real daemon: control socket, skippyd status/top --once, /metrics."""

from __future__ import annotations

import json
import stat

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.control.client import ControlClient

pytestmark = pytest.mark.model
runner = CliRunner()


def metric_value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_control_socket_is_private(server):
    mode = server.socket_path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_status_and_top_once_read_the_daemon(server, client):
    before = json.loads(runner.invoke(app, ["top", "--once", "--json", "--socket",
                                            str(server.socket_path)]).output)
    client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=5, temperature=0)
    result = runner.invoke(app, ["top", "--once", "--json", "--socket", str(server.socket_path)])
    assert result.exit_code == 0, result.output
    after = json.loads(result.output)
    assert after["stage"]["id"] == "e2e" and after["health"]["status"] == "ok"
    assert after["lane_count"] == 8
    assert after["counters"]["finished"] >= before["counters"]["finished"] + 1
    assert after["counters"]["generation_tokens"] >= before["counters"]["generation_tokens"] + 5
    status = runner.invoke(app, ["status", "--socket", str(server.socket_path)])
    assert status.exit_code == 0, status.output
    assert "e2e" in status.output


def test_metrics_counters_move(server, client):
    before = httpx.get(server.base_url + "/metrics").text
    client.completions.create(model="any", prompt="A, B, C,", max_tokens=6, temperature=0)
    after = httpx.get(server.base_url + "/metrics").text
    assert (metric_value(after, "skippyd_generation_tokens_total")
            >= metric_value(before, "skippyd_generation_tokens_total") + 6)
    assert (metric_value(after, "skippyd_time_to_first_token_seconds_count")
            > metric_value(before, "skippyd_time_to_first_token_seconds_count"))


def test_the_event_stream_tells_a_requests_life(server, client):
    # The shared daemon runs at the default telemetry.level: summary events only.
    with ControlClient.connect(server.socket_path, timeout_s=30) as control:
        messages = control.events()
        client.completions.create(model="any", prompt="Colours: red,", max_tokens=4,
                                  temperature=0)
        seen: list[dict] = []
        for message in messages:
            seen.append(message["event"])
            if message["event"]["name"] == "request.finished":
                break
    names = [event["name"] for event in seen]
    assert "request.admitted" in names and names[-1] == "request.finished"
    assert all(event["level"] == "summary" for event in seen)
    assert not any(name.startswith("worker.step") for name in names)
    finished = seen[-1]["attributes"]
    assert finished["reason"] == "length" and finished["generated_tokens"] == 4
