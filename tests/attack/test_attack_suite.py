"""Attacks on a real ``skippyd serve`` (the suite's tiny model): the daemon stays healthy,
its memory within a stated bound, and legitimate clients are served meanwhile.

Deadlines are set short (2 s) so each case runs in seconds; ``bench/attack.py`` runs the
same cases at the default deadlines on SmolLM2. Figures come from /proc (Linux).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serve_process import ServeProcess  # noqa: E402

from skippyd.bench.attacks import (  # noqa: E402
    SLOW_HEAD,
    Drippers,
    IdleFlood,
    ProbeLoop,
    process_figures,
    running,
    slow_body_request,
)

API_KEY = "attack-suite-api-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DEADLINE_S = 2.0
#: Stated bound: 1 000 idle connections may cost the daemon at most this much RSS.
RSS_BOUND_MIB = 64
WAIT_S = 60.0


def _config(model: Path, workdir: Path, extra: str = "", header_s: float = DEADLINE_S) -> str:
    return f"""
[stage]
id = "attack"
model_path = "{model}"

[runtime]
ctx_size = 1024
lane_count = 4
threads = 1
threads_batch = 1

[http]
listen = "127.0.0.1:0"
api_key = "{API_KEY}"
header_timeout_s = {header_s}
body_timeout_s = {DEADLINE_S}
keep_alive_timeout_s = {DEADLINE_S}
{extra}
[control]
socket = "{workdir / 'control.sock'}"
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_path):
    workdir = tmp_path_factory.mktemp("attack")
    proc = ServeProcess(_config(tiny_model_path, workdir), workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _address(daemon) -> tuple[str, int]:
    host, port = re.match(r"http://([^:/]+):(\d+)", daemon.url).groups()
    return host, int(port)


def _complete(daemon, i: int) -> int:
    response = httpx.post(f"{daemon.base_url}/v1/completions", headers=AUTH, timeout=WAIT_S,
                          json={"prompt": f"client {i} says", "max_tokens": 6})
    return response.status_code


def _clients(daemon, n: int, each: int) -> list[int]:
    """``n`` clients in parallel, ``each`` completions apiece; returns every status."""
    statuses: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for _ in range(each):
            status = _complete(daemon, i)
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * each)
    return statuses


def _wait_for(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_thousand_idle_connections_beside_eight_clients(daemon):
    pid = daemon.proc.pid
    assert _clients(daemon, 8, 2) == [200] * 16  # warm-up
    before = process_figures(pid)
    flood = IdleFlood(_address(daemon), 1000)
    probe = ProbeLoop(daemon.base_url, every_s=0.2)
    with running(flood, probe):
        _wait_for(lambda: process_figures(pid)["fds"] >= before["fds"] + 900,
                  "the daemon to hold the idle connections")
        peak = process_figures(pid)
        statuses = _clients(daemon, 8, 5)
        # Every idle connection is closed at its header deadline (and reopened).
        _wait_for(lambda: flood.stats.cut >= 1000, "the header deadline to close them")
    assert statuses == [200] * 40
    assert probe.failures == 0 and probe.answers.get("200", 0) > 0, probe.answers
    assert (peak["rss_kib"] - before["rss_kib"]) / 1024 < RSS_BOUND_MIB
    assert min(flood.stats.lifetimes_s) >= DEADLINE_S * 0.9
    _wait_for(lambda: process_figures(pid)["fds"] <= before["fds"], "the fds to come back")


def test_health_probes_never_fail_under_connection_attacks(daemon):
    address = _address(daemon)
    heads = Drippers(address, 16, SLOW_HEAD, every_s=0.2)
    head, body = slow_body_request()
    bodies = Drippers(address, 16, body, every_s=0.2, prefix=head)
    idle = IdleFlood(address, 300)
    probe = ProbeLoop(daemon.base_url, every_s=0.2)
    with running(heads, bodies, idle, probe):
        statuses = _clients(daemon, 4, 3)
        _wait_for(lambda: heads.stats.cut >= 16 and bodies.stats.cut >= 16,
                  "the drippers to be cut at their deadlines")
    assert statuses == [200] * 12
    assert probe.failures == 0 and probe.answers.get("200", 0) > 0, probe.answers
    assert heads.completed == 0 and bodies.completed == 0  # no dripper ever finished


def test_idle_connections_give_way_when_the_cap_is_reached(tmp_path, tiny_model_path):
    proc = ServeProcess(_config(tiny_model_path, tmp_path, "max_open_connections = 64\n",
                                header_s=60), tmp_path)
    try:
        proc.wait_ready()
        flood = IdleFlood(_address(proc), 200, reopen=False)
        with running(flood):
            assert httpx.get(f"{proc.base_url}/health", timeout=WAIT_S).status_code == 200
            assert _clients(proc, 4, 2) == [200] * 8
            _wait_for(lambda: flood.stats.cut >= 200 - 64, "idle connections to give way")
    finally:
        proc.stop()


def test_wrong_keys_are_refused_and_logged_rate_limited(daemon):
    for _ in range(100):
        response = httpx.get(f"{daemon.base_url}/v1/models", timeout=WAIT_S,
                             headers={"Authorization": "Bearer guess"})
        assert response.status_code == 401
    lines = [line for line in daemon.lines if "invalid API key" in line]
    assert 1 <= len(lines) <= 3  # the suite's other tests may add one more per 10 s
    assert httpx.get(f"{daemon.base_url}/v1/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
    b'{"messages": [{"role": "user", "content": "a"}], "stop": ["\\udc80"]}',
    b"\xff\xfe{not utf-8}",
], ids=["surrogate", "nesting-bomb", "oversize", "surrogate-stop", "not-utf8"])
def test_hostile_bodies_get_a_4xx_never_a_500(daemon, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{daemon.base_url}{path}", content=raw, timeout=WAIT_S,
                              headers={**AUTH, "Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, response.text[:200]
        assert response.json()["error"]["message"]
    assert "Traceback" not in daemon.log()
    assert _complete(daemon, 0) == 200
