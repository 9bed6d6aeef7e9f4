"""With no ``runtime.ctx_size`` every request may hold the model's trained context.

The embedded SmolLM2 was trained for 8 192 tokens: each lane's KV stream gets that many
cells (the machines running the tests have far more memory than two lanes need), the
start-up log says so, the API reports it, and a chat longer than the lanes' share of one
trained context (what sizing the lanes together from it would give each) is answered.
"""

from __future__ import annotations

import httpx
import pytest
from serve_process import ServeProcess

pytestmark = pytest.mark.model

TRAINED = 8192


def test_an_open_context_gives_each_lane_the_trained_context(tmp_path):
    config = (f'[stage]\nid = "open"\n[runtime]\nlane_count = 2\nthreads = 2\n'
              f'threads_batch = 2\n[http]\nlisten = "127.0.0.1:0"\n'
              f'[control]\nsocket = "{tmp_path / "c.sock"}"\n')
    proc = ServeProcess(config, tmp_path).wait_ready()
    try:
        line = proc.wait_for_line(r"runtime\.ctx_size = \d+ cells")
        assert f"runtime.ctx_size = {2 * TRAINED} cells" in line
        assert f"each lane gets the model's trained context ({TRAINED} tokens)" in line
        props = httpx.get(proc.base_url + "/props", timeout=30).json()
        assert props["default_generation_settings"]["n_ctx"] == TRAINED
        reps = 100
        while len(httpx.post(proc.base_url + "/tokenize", timeout=30, json={
                "content": "river stone cloud " * reps}).json()["tokens"]) < 0.6 * TRAINED:
            reps = reps * 13 // 10
        words = "river stone cloud " * reps
        response = httpx.post(proc.url + "/chat/completions", timeout=300, json={
            "model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"Summarize: {words}"}]})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert TRAINED // 2 < usage["prompt_tokens"] < TRAINED
    finally:
        assert proc.stop() == 0, proc.log()
