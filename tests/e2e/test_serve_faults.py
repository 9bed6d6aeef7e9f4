"""A fault inside the worker of a real ``skippyd serve``: clients get an error at once,
the daemon reports why, and (for a fatal fault) exits with 7 for its supervisor."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import openai
import pytest
from openai import OpenAI
from serve_process import ServeProcess, stage_config

from skippyd.exitcodes import ExitCode

#: A client must hear of a fault within this (generous for a loaded CI machine).
ANSWER_S = 10.0


def serve_with_fault(tmp_path, fault: str) -> ServeProcess:
    env = dict(os.environ, SKIPPYD_FAULT=fault)
    return ServeProcess(stage_config(lanes=2, ctx_size=2048), tmp_path, env=env).wait_ready()


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


def test_a_fatal_worker_fault_answers_every_client_and_exits_7(tmp_path):
    proc = serve_with_fault(tmp_path, "raise-in=execute:3")
    try:
        client = OpenAI(base_url=proc.url, api_key="unused", max_retries=0,
                        timeout=ANSWER_S)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: ask(client, i, stream=i % 2 == 0), range(4)))
        assert all(answer.startswith("error: ") for answer in answers), answers
        assert proc.proc.wait(timeout=30) == ExitCode.WORKER_FAILED, proc.log()
        log = proc.log()
        assert "fault injected in execute" in log and "worker failed" in log.lower()
    finally:
        proc.stop()


def test_a_request_local_fault_fails_one_request_and_the_next_succeeds(tmp_path):
    proc = serve_with_fault(tmp_path, "raise-in=prepare")
    try:
        client = OpenAI(base_url=proc.url, api_key="unused", max_retries=0,
                        timeout=ANSWER_S)
        assert ask(client, 0, stream=False).startswith("error: ")
        health = httpx.get(proc.base_url + "/health", timeout=ANSWER_S)
        assert health.status_code == 200, health.text
        assert not ask(client, 1, stream=True).startswith("error: ")
        assert not ask(client, 2, stream=False).startswith("error: ")
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("value", ["raise-in=nowhere", "raise-in=plan:0"])
def test_a_bad_fault_value_stops_the_start(tmp_path, value):
    env = dict(os.environ, SKIPPYD_FAULT=value)
    proc = ServeProcess(stage_config(lanes=2, ctx_size=2048), tmp_path, env=env)
    code = proc.proc.wait(timeout=120)
    proc.stop()
    assert code != 0 and "SKIPPYD_FAULT" in proc.log()
