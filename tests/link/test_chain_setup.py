"""Stage 0 refuses to form a chain its later stages cannot carry, and says why."""

from __future__ import annotations

import httpx
from link_support import tiny_chain, wait_until


def test_a_later_stage_with_a_smaller_n_batch_keeps_the_chain_down(tmp_path, tiny_model_path):
    with tiny_chain(tiny_model_path, tmp_path, n_batch=(128, 64)) as (head, _later):
        head.wait_for_line(r"runtime\.n_batch", timeout=30)

        def reason() -> str:
            return httpx.get(head.base_url + "/health", timeout=5).json().get("reason") or ""

        wait_until(lambda: "runtime.n_batch" in reason(), 10, "/health to name n_batch")
        health = httpx.get(head.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "at most 64 tokens per batch" in health.json()["reason"]
        assert "stage 0's 128" in health.json()["reason"]
        refused = httpx.post(head.url + "/completions", json={"prompt": "a b", "max_tokens": 2})
        assert refused.status_code == 503
