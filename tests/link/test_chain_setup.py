"""Stage 0 refuses to form a chain its later stages cannot carry, and says why."""

from __future__ import annotations

import httpx
from link_support import STAGE_READY, free_port, tiny_stage, wait_until
from serve_process import ServeProcess


def test_a_later_stage_with_a_smaller_n_batch_keeps_the_chain_down(tmp_path, tiny_model_path):
    ports = [free_port(), free_port()]
    dirs = [tmp_path / "s0", tmp_path / "s1"]
    for directory in dirs:
        directory.mkdir()
    later = ServeProcess(tiny_stage(tiny_model_path, tmp_path, index=1, layers=(2, 4),
                                    n_batch=64, ports=ports), dirs[1])
    head = ServeProcess(tiny_stage(tiny_model_path, tmp_path, index=0, layers=(0, 2),
                                   n_batch=128, ports=ports), dirs[0])
    try:
        later.wait_for_line(STAGE_READY, timeout=60)
        head.wait_ready()
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
    finally:
        head.stop()
        later.stop()
