"""systemd integration: sd_notify READY/STOPPING, draining on SIGTERM, the watchdog."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

# NOTE: one llama.cpp thread: two threads spinning at barriers on a loaded two-core
# machine stretch decode steps to ~1 s, and the stream in flight outlived the drain.
RUNTIME = """
[runtime]
ctx_size = 1024
lane_count = 2
threads = 1
threads_batch = 1
"""


def tiny_config(model: Path) -> str:
    return f"""
[stage]
id = "notify"
model_path = "{model}"
{RUNTIME}
[http]
listen = "127.0.0.1:0"
drain_timeout_s = 60
"""


class NotifySocket:
    """A Unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def wait_for(self, key: str, timeout: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {key} in {self.messages}")
            self.sock.settimeout(remaining)
            fields = self.receive()
            if key in fields:
                return fields

    def receive(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
        self.messages.append((time.monotonic(), fields))
        return fields

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    sock = NotifySocket(tmp_path)
    yield sock
    sock.close()


def start(tmp_path, tiny_model_path, notify, **env) -> ServeProcess:
    environ = {**os.environ, "NOTIFY_SOCKET": str(notify.path), **env}
    return ServeProcess(tiny_config(tiny_model_path), tmp_path, env=environ)


def test_ready_only_when_healthy_then_drain_on_sigterm(tmp_path, tiny_model_path, notify):
    proc = start(tmp_path, tiny_model_path, notify)
    try:
        ready = notify.wait_for("READY")
        assert ready["READY"] == "1"
        assert "serving" in ready["STATUS"]
        proc.wait_ready()
        assert httpx.get(proc.base_url + "/health").status_code == 200
        assert not any("READY" in f for _, f in notify.messages[:-1])

        # A request in flight during SIGTERM completes in full.
        result: dict = {}
        first_token = threading.Event()

        def stream() -> None:
            text, finish = [], None
            result["error"] = "stream did not finish"
            with httpx.stream("POST", proc.url + "/completions", timeout=60, json={
                "prompt": "the cat", "max_tokens": 150, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            }) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    first_token.set()
                    chunk = httpx.Response(200, content=line[6:]).json()
                    if chunk.get("usage"):
                        result["usage"] = chunk["usage"]
                    for choice in chunk["choices"]:
                        text.append(choice["text"])
                        finish = choice["finish_reason"] or finish
            result["finish"] = finish

        client = threading.Thread(target=stream)
        client.start()
        assert first_token.wait(30)
        proc.proc.send_signal(signal.SIGTERM)
        assert notify.wait_for("STOPPING")["STOPPING"] == "1"
        client.join(60)
        assert result["status"] == 200
        assert result.get("finish") == "length", proc.log()
        assert result["usage"]["completion_tokens"] == 150
        assert proc.proc.wait(timeout=60) == 0
    finally:
        proc.stop(signal.SIGKILL)


def test_watchdog_pings_stop_when_the_worker_hangs(tmp_path, tiny_model_path, notify):
    proc = start(tmp_path, tiny_model_path, notify, WATCHDOG_USEC="1000000",
                 SKIPPYD_FAULT="hang-iteration")
    try:
        notify.wait_for("READY")
        proc.wait_ready()
        notify.wait_for("WATCHDOG", timeout=5)  # an idle, healthy worker is pinged for
        def hung_request() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
                httpx.post(proc.url + "/completions", timeout=30,
                           json={"prompt": "the", "max_tokens": 4})

        threading.Thread(target=hung_request, daemon=True).start()
        # The iteration hangs: within a watchdog period the pings stop for good.
        deadline = time.monotonic() + 10
        last_ping = time.monotonic()
        while time.monotonic() < deadline:
            notify.sock.settimeout(0.5)
            try:
                fields = notify.receive()
            except TimeoutError:
                continue
            if "WATCHDOG" in fields:
                last_ping = time.monotonic()
            if time.monotonic() - last_ping > 3:
                break
        assert time.monotonic() - last_ping > 3, "watchdog kept pinging a hung worker"
        health = httpx.get(proc.base_url + "/health")
        assert health.status_code == 503
        assert "hung" in health.text
    finally:
        proc.stop(signal.SIGKILL)


def test_concurrent_request_limit_names_itself(tmp_path, tiny_model_path, notify):
    config = tiny_config(tiny_model_path).replace(
        "drain_timeout_s = 60", "drain_timeout_s = 60\nmax_connections = 2")
    proc = ServeProcess(config, tmp_path, env={**os.environ})
    try:
        proc.wait_ready()
        streams, opened = [], threading.Barrier(3, timeout=30)

        def hold_stream() -> None:
            with httpx.stream("POST", proc.url + "/completions", timeout=60, json={
                "prompt": "the", "max_tokens": 400, "ignore_eos": True, "stream": True,
            }) as response:
                streams.append(response.status_code)
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                opened.wait()
                opened.wait()  # hold the request open until the check below is done

        holders = [threading.Thread(target=hold_stream) for _ in range(2)]
        for t in holders:
            t.start()
        opened.wait()
        refused = httpx.post(proc.url + "/completions", json={"prompt": "hi", "max_tokens": 2})
        health = httpx.get(proc.base_url + "/health")
        opened.wait()
        for t in holders:
            t.join(30)
        assert streams == [200, 200]
        assert refused.status_code == 429
        assert "max_connections=2" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"] == "1"
        assert health.status_code == 200
    finally:
        proc.stop(signal.SIGKILL)


def link_stage_config(model: Path, control_socket: Path) -> str:
    """The final stage (layers 2-4 of the tiny model) of a split pipeline: no HTTP."""
    return f"""
[stage]
id = "notify-link"
index = 1
layer_start = 2
layer_end = 4
model_path = "{model}"
{RUNTIME}slice_cache_dir = "{control_socket.parent / 'slices'}"

[link]
listen = "127.0.0.1:0"
secret = "systemd-link-stage-secret-0123456789"

[upstream]
stage_id = "stage-0"
endpoint = "127.0.0.1:9"

[control]
socket = "{control_socket}"
"""


def test_link_stage_notifies_systemd_and_answers_on_its_control_socket(
        tmp_path, tiny_model_path, notify):
    control_socket = tmp_path / "link.sock"
    proc = ServeProcess(link_stage_config(tiny_model_path, control_socket), tmp_path,
                        env={**os.environ, "NOTIFY_SOCKET": str(notify.path),
                             "WATCHDOG_USEC": "2000000"})
    try:
        ready = notify.wait_for("READY")
        assert ready["READY"] == "1"
        assert "serving layers 2:4" in ready["STATUS"]
        proc.wait_for_line(r"skippyd stage notify-link serving layers 2:4 on link")
        notify.wait_for("WATCHDOG", timeout=5)

        status = subprocess.run(
            [sys.executable, "-m", "skippyd.cli", "status", "--socket", str(control_socket),
             "--json"], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        snapshot = json.loads(status.stdout)
        assert snapshot["stage"]["id"] == "notify-link"
        assert snapshot["stage"]["index"] == 1 and snapshot["stage"]["is_final"]
        assert (snapshot["stage"]["layer_start"], snapshot["stage"]["layer_end"]) == (2, 4)
        assert snapshot["health"]["status"] == "ok"

        proc.proc.send_signal(signal.SIGTERM)
        assert notify.wait_for("STOPPING")["STOPPING"] == "1"
        assert proc.proc.wait(timeout=60) == 0
        assert not control_socket.exists()
    finally:
        proc.stop(signal.SIGKILL)


def test_journal_lines_carry_priorities_and_requests_and_throughput_are_logged(
        tmp_path, tiny_model_path):
    config = tiny_config(tiny_model_path) + "\n[telemetry]\nstats_interval_s = 0.5\n"
    proc = ServeProcess(config, tmp_path, journal=True)
    try:
        proc.wait_ready()
        response = httpx.post(proc.url + "/completions", timeout=60, json={
            "prompt": "the cat", "max_tokens": 8, "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200
        request_id = response.json()["id"]
        line = proc.wait_for_line(rf"request {request_id}: ")
        assert re.fullmatch(
            rf"<6>skippyd\.http\.observability\.request_log: request {request_id}: 200 length,"
            r" prompt \d+ tok \(cached 0\), generated 8 tok, queue [\d.]+ ms, ttft [\d.]+ ms,"
            r" decode [\d.]+ tok/s, total [\d.]+ ms", line.rstrip("\n")), line
        throughput = proc.wait_for_line(r"throughput: prompt")
        assert throughput.startswith("<6>skippyd.daemon.stats_log: throughput: prompt")
        assert proc.stop() == 0
    finally:
        proc.stop(signal.SIGKILL)
    logged = [line for line in proc.lines if not line.startswith("skippyd serving ")]
    assert logged and all(re.match(r"<[2-7]>\S", line) for line in logged), proc.log()
    # No timestamp of our own: the journal stamps every entry.
    assert not any(re.search(r"\d\d:\d\d:\d\d", line) for line in logged), proc.log()


@pytest.mark.model
def test_watchdog_keeps_pinging_through_a_long_prefill_that_computes(tmp_path, smollm2_path,
                                                                     notify):
    # A 1 s watchdog: a stuck call must be caught within 0.5 s, yet one prefill of
    # ~1800 tokens on one thread runs for seconds and must not count as stuck.
    config = f"""
[stage]
id = "long-prefill"
model_path = "{smollm2_path}"
[runtime]
ctx_size = 2048
lane_count = 1
n_batch = 2048
n_ubatch = 512
threads = 1
threads_batch = 1
[kv_cache]
mode = "disabled"
[http]
listen = "127.0.0.1:0"
"""
    proc = ServeProcess(config, tmp_path, env={**os.environ, "NOTIFY_SOCKET": str(notify.path),
                                               "WATCHDOG_USEC": "1000000"})
    try:
        notify.wait_for("READY")
        proc.wait_ready()
        prompt = " ".join(["word"] * 1800)
        done = threading.Event()
        timings: dict[str, float] = {}

        def long_prefill() -> None:
            started = time.monotonic()
            with httpx.stream("POST", proc.url + "/completions", timeout=300, json={
                    "prompt": prompt, "max_tokens": 1, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        timings["ttft"] = time.monotonic() - started
                        break
            done.set()

        client = threading.Thread(target=long_prefill)
        notify.wait_for("WATCHDOG", timeout=5)
        client.start()
        pings, started = [], time.monotonic()
        while not done.is_set():
            notify.sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                if "WATCHDOG" in notify.receive():
                    pings.append(time.monotonic())
        client.join(60)
        assert timings.get("ttft", 0) > 2.0, f"the prefill was too short to tell: {timings}"
        gaps = [b - a for a, b in zip([started, *pings], [*pings, time.monotonic()],
                                      strict=True)]
        assert max(gaps) < 1.0, f"watchdog pings stopped for {max(gaps):.1f} s"
        assert httpx.get(proc.base_url + "/health").status_code == 200
    finally:
        proc.stop(signal.SIGKILL)
