"""Stage 0 refuses to form a chain its later stages cannot carry, and says why."""

from __future__ import annotations

import httpx
from link_support import tiny_chain, wait_until


def _reason(head) -> str:
    return httpx.get(head.base_url + "/health", timeout=5).json().get("reason") or ""


def test_a_later_stage_with_a_smaller_n_batch_keeps_the_chain_down(tmp_path, tiny_model_path):
    with tiny_chain(tiny_model_path, tmp_path, n_batch=(128, 64)) as (head, _later):
        head.wait_for_line(r"runtime\.n_batch", timeout=30)

        def reason() -> str:
            return _reason(head)

        wait_until(lambda: "runtime.n_batch" in reason(), 10, "/health to name n_batch")
        health = httpx.get(head.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "at most 64 tokens per batch" in health.json()["reason"]
        assert "stage 0's 128" in health.json()["reason"]
        refused = httpx.post(head.url + "/completions", json={"prompt": "a b", "max_tokens": 2})
        assert refused.status_code == 503


def test_a_later_stage_with_less_room_per_session_keeps_the_chain_down(tmp_path,
                                                                       tiny_model_path):
    # Same ctx_size, more lanes, a stream per lane: each of the later stage's lanes holds
    # half as many tokens, so a session stage 0 can grow to 512 tokens would not fit
    # behind it. (In one shared pool every session may use all of it.)
    with tiny_chain(tiny_model_path, tmp_path, lanes=(1, 2),
                    kv_layout="per_lane") as (head, _later):
        head.wait_for_line("tokens per session", timeout=30)
        wait_until(lambda: "tokens per session" in _reason(head), 10,
                   "/health to name the per-session capacity")
        reason = _reason(head)
        assert "at most 256 tokens per session" in reason
        assert "stage 0's 512" in reason
