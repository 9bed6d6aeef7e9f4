"""A fatal fault in one stage's worker reaches the other stages of its chain."""

from __future__ import annotations

import os

import httpx
from link_support import tiny_chain, wait_until

from skippyd.exitcodes import ExitCode

ANSWER_S = 10.0


def _wait_connected(head) -> None:
    wait_until(lambda: httpx.get(head.base_url + "/health", timeout=5).status_code == 200,
               30, "the chain to connect")


def _generate(head) -> httpx.Response:
    return httpx.post(head.url + "/completions", timeout=ANSWER_S,
                      json={"prompt": "a b c", "max_tokens": 8})


def test_a_failed_head_stage_sends_its_peers_an_error_frame(tmp_path, tiny_model_path):
    env = dict(os.environ, SKIPPYD_FAULT="raise-in=execute")
    with tiny_chain(tiny_model_path, tmp_path, env=(env, None)) as (head, later):
        _wait_connected(head)
        assert _generate(head).status_code >= 500
        head.wait_for_line("the worker failed", timeout=ANSWER_S)
        reported = later.wait_for_line("the chain from .* reports", timeout=ANSWER_S)
        assert "tiny-0" in reported and "fault injected in execute" in reported
        assert later.proc.poll() is None  # the later stage goes on serving
        assert head.stop(timeout=30) == ExitCode.WORKER_FAILED, head.log()


def test_a_fatal_fault_in_a_later_stage_fails_the_request_and_exits_7(tmp_path,
                                                                     tiny_model_path):
    env = dict(os.environ, SKIPPYD_FAULT="raise-in=command")
    with tiny_chain(tiny_model_path, tmp_path, env=(None, env)) as (head, later):
        _wait_connected(head)
        reply = _generate(head)
        assert reply.status_code >= 500, reply.text
        assert "fault injected in command" in reply.text
        assert later.proc.wait(timeout=30) == ExitCode.WORKER_FAILED, later.log()


def test_a_local_fault_in_a_later_stage_fails_one_request_only(tmp_path, tiny_model_path):
    env = dict(os.environ, SKIPPYD_FAULT="raise-in=direct")
    with tiny_chain(tiny_model_path, tmp_path, env=(None, env)) as (head, later):
        _wait_connected(head)
        failed = _generate(head)
        assert failed.status_code >= 500 and "fault injected in direct" in failed.text
        assert _generate(head).status_code == 200
        assert httpx.get(head.base_url + "/health", timeout=ANSWER_S).status_code == 200
        assert later.proc.poll() is None
