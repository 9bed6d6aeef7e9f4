"""A fault inside the worker of a real ``skippyd serve``: clients get an error at once,
the daemon reports why, and (for a fatal fault) exits with 7 for its supervisor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os

import httpx
import openai
import pytest
from openai import OpenAI
from serve_process import ServeProcess, stage_config
from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.exitcodes import ExitCode

#: A client must hear of a fault within this (generous for a loaded CI machine).
ANSWER_S = 10.0


def serve_with_fault(tmp_path, fault: str, **config) -> ServeProcess:
    env = dict(os.environ, SKIPPYD_FAULT=fault)
    return ServeProcess(stage_config(lanes=2, ctx_size=2048, **config), tmp_path,
                        env=env).wait_ready()


def ask(client: OpenAI, index: int, stream: bool) -> str:
    """One chat completion; the text, or the name of the error the client got."""
    try:
        if stream:
            chunks = client.chat.completions.create(
                model="m", stream=True, max_tokens=64,
                messages=[{"role": "user", "content": f"Count to ten, take {index}."}])
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = client.chat.completions.create(
            model="m", max_tokens=64,
            messages=[{"role": "user", "content": f"Count to ten, take {index}."}])
        return reply.choices[0].message.content or ""
    except openai.APIError as exc:
        return f"error: {type(exc).__name__}"


def test_a_fatal_worker_fault_answers_every_client_reports_why_and_exits_7(tmp_path):
    drain_s = 4.0
    socket = tmp_path / "control.sock"
    proc = serve_with_fault(tmp_path, "raise-in=execute:3", socket=str(socket),
                            extra=f"drain_timeout_s = {drain_s}")
    try:
        client = OpenAI(base_url=proc.url, api_key="unused", max_retries=0,
                        timeout=ANSWER_S)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: ask(client, i, stream=i % 2 == 0), range(4)))
        assert all(answer.startswith("error: ") for answer in answers), answers
        proc.wait_for_line("the worker failed", timeout=ANSWER_S)

        # Until its drain time is up, the daemon stays to say why it is not serving.
        health = httpx.get(proc.base_url + "/health", timeout=ANSWER_S)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "failed"
        assert "fault injected in execute" in health.json()["reason"]
        status = CliRunner().invoke(app, ["status", "--socket", str(socket)])
        assert status.exit_code == ExitCode.FAILURE, status.output
        text = " ".join(status.output.split())  # the reason may wrap at the width
        assert "health failed" in text and "fault injected in execute" in text, text
        refused = httpx.post(proc.url + "/chat/completions", timeout=ANSWER_S, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert proc.proc.poll() is None

        assert proc.proc.wait(timeout=drain_s + 30) == ExitCode.WORKER_FAILED, proc.log()
        assert "fault injected in execute" in proc.log()
    finally:
        proc.stop()


def test_a_signal_after_a_fatal_fault_ends_the_drain_at_once_still_with_7(tmp_path):
    proc = serve_with_fault(tmp_path, "raise-in=plan", extra="drain_timeout_s = 600")
    try:
        client = OpenAI(base_url=proc.url, api_key="unused", max_retries=0,
                        timeout=ANSWER_S)
        assert ask(client, 0, stream=True).startswith("error: ")
        proc.wait_for_line("the worker failed", timeout=ANSWER_S)
    finally:
        code = proc.stop(timeout=30)
    assert code == ExitCode.WORKER_FAILED, proc.log()


def held_resources(proc: ServeProcess, socket) -> tuple[int, int, int, list[str]]:
    """What the daemon holds between requests: file descriptors other than sockets
    (clients' keep-alive connections come and go), threads, worker sessions, and each
    lane's phase."""
    fds = f"/proc/{proc.proc.pid}/fd"
    targets = []
    for fd in os.listdir(fds):
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            targets.append(os.readlink(os.path.join(fds, fd)))
    files = [target for target in targets if not target.startswith("socket:")]
    snap = json.loads(CliRunner().invoke(
        app, ["top", "--once", "--json", "--socket", str(socket)]).output)
    return (len(files), len(os.listdir(f"/proc/{proc.proc.pid}/task")),
            snap["wave"]["active_sessions"], [lane["phase"] for lane in snap["lanes"]])


@pytest.mark.parametrize("point", ["prepare", "prefix-cache"])
def test_a_request_local_fault_fails_its_step_only_and_leaks_nothing(tmp_path, point):
    socket = tmp_path / "control.sock"
    proc = serve_with_fault(tmp_path, f"raise-in={point}:3", socket=str(socket))
    try:
        client = OpenAI(base_url=proc.url, api_key="unused", max_retries=0,
                        timeout=ANSWER_S)
        # Two requests warm every pool up; the fault waits for the third.
        assert not ask(client, 0, stream=True).startswith("error: ")
        assert not ask(client, 1, stream=False).startswith("error: ")
        before = held_resources(proc, socket)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda i: ask(client, i, stream=i % 2 == 0), (2, 3)))
        assert any(answer.startswith("error: ") for answer in answers), answers
        health = httpx.get(proc.base_url + "/health", timeout=ANSWER_S)
        assert health.status_code == 200, health.text
        assert not ask(client, 4, stream=True).startswith("error: ")
        assert not ask(client, 5, stream=False).startswith("error: ")
        assert held_resources(proc, socket) == before
        assert before[2] == 0 and set(before[3]) == {"idle"}
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("value", ["raise-in=nowhere", "raise-in=plan:0"])
def test_a_bad_fault_value_stops_the_start(tmp_path, value):
    env = dict(os.environ, SKIPPYD_FAULT=value)
    proc = ServeProcess(stage_config(lanes=2, ctx_size=2048), tmp_path, env=env)
    code = proc.proc.wait(timeout=120)
    proc.stop()
    assert code != 0 and "SKIPPYD_FAULT" in proc.log()
