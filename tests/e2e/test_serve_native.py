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


def test_without_the_native_helpers_the_daemon_serves_the_same_tokens(tmp_path):
    # Two fresh daemons: in one shared KV pool the cells an earlier request kept move
    # the last bits of a later request's logits, so both start from an empty pool.
    for name in ("native", "plain"):
        (tmp_path / name).mkdir()
    native = ServeProcess(stage_config(socket=str(tmp_path / "native.sock")),
                          tmp_path / "native").wait_ready()
    try:
        plain = ServeProcess(stage_config(socket=str(tmp_path / "plain.sock")), tmp_path / "plain",
                             env=dict(os.environ, SKIPPYD_NATIVE="off")).wait_ready()
        try:
            assert _greedy(_client(plain)) == _greedy(_client(native))
            props = httpx.get(plain.base_url + "/props", timeout=30).json()
            assert props["fast_paths"]["wake_before_decode"] == "python (SKIPPYD_NATIVE=off)"
            assert "fast paths: activation capture: python" in plain.log()
        finally:
            assert plain.stop() == 0, plain.log()
    finally:
        assert native.stop() == 0, native.log()


def _client(proc: ServeProcess) -> OpenAI:
    return OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
