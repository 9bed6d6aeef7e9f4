"""The native helpers of a real daemon: reported where an operator looks, and optional."""

from __future__ import annotations

import os

import httpx
from openai import OpenAI
from serve_process import ServeProcess, stage_config

PROMPT = [{"role": "user", "content": "Name three colours."}]


def _greedy(client: OpenAI) -> str:
    reply = client.chat.completions.create(model="m", messages=PROMPT, max_tokens=24,
                                           temperature=0)
    return reply.choices[0].message.content or ""


def test_the_daemon_reports_its_fast_paths(server):
    props = httpx.get(server.base_url + "/props", timeout=30).json()
    assert props["fast_paths"]["wake_before_decode"] == "native", props["fast_paths"]
    assert props["fast_paths"]["greedy_pick"].startswith("numpy")
    assert "fast paths: activation capture: native" in server.log()


def test_without_the_native_helpers_the_daemon_serves_the_same_tokens(server, client,
                                                                      tmp_path):
    env = dict(os.environ, SKIPPYD_NATIVE="off")
    proc = ServeProcess(stage_config(), tmp_path, env=env).wait_ready()
    try:
        plain = OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
        assert _greedy(plain) == _greedy(client)
        props = httpx.get(proc.base_url + "/props", timeout=30).json()
        assert props["fast_paths"]["wake_before_decode"] == "python (SKIPPYD_NATIVE=off)"
        assert "fast paths: activation capture: python" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()
