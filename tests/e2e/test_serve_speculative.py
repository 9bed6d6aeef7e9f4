"""Speculative decoding in a real daemon: drafts change how fast, not what.

Greedy answers with drafts are compared with the same daemon's answers without them.
Verifying a draft computes its row in a batch of another shape than plain decoding
would, and llama.cpp's kernels then round the last bits of the logits differently; where
the two best tokens are nearly tied that can flip a token. The prompts here ask for
text the model copies (a list it is told to repeat), where the best token leads by far.
"""

from __future__ import annotations

import httpx
import pytest
from serve_process import ServeProcess, stage_config

from skippyd.config import default_model_path
from skippyd.exitcodes import ExitCode

pytestmark = pytest.mark.model

COPY = [{"role": "user", "content":
         "Repeat this list exactly, one item per line: apple, river, candle, mountain, "
         "violin, harbour, lantern, meadow, copper, falcon, apple, river, candle, "
         "mountain, violin, harbour, lantern, meadow, copper, falcon."}]


def daemon(tmp_path, name: str, speculative: str) -> ServeProcess:
    workdir = tmp_path / name
    workdir.mkdir()
    config = stage_config(lanes=2, ctx_size=2048, socket=str(workdir / "c.sock"),
                          extra=f"[speculative]\n{speculative}\n")
    return ServeProcess(config, workdir).wait_ready()


def answer(proc: ServeProcess, **extra) -> dict:
    response = httpx.post(proc.url + "/chat/completions", timeout=120, json={
        "model": "m", "messages": COPY, "max_tokens": 80, "temperature": 0, **extra})
    response.raise_for_status()
    return response.json()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    proc = daemon(tmp_path_factory.mktemp("plain"), "off", 'mode = "off"')
    try:
        yield proc
    finally:
        proc.stop()


def test_ngram_drafts_give_the_answer_plain_decoding_gives(plain, tmp_path):
    expected = text(answer(plain))
    proc = daemon(tmp_path, "ngram", 'mode = "ngram"')
    try:
        body = answer(proc)
        assert text(body) == expected
        drafts = body["usage"]["completion_tokens_details"]
        assert drafts["accepted_prediction_tokens"] > 0
        assert body["timings"]["draft_n_accepted"] == drafts["accepted_prediction_tokens"]
        status = httpx.get(proc.base_url + "/metrics", timeout=30).text
        assert "skippyd_speculative_accepted_tokens_total" in status
        opted_out = answer(proc, speculative=False)
        assert text(opted_out) == expected and "timings" not in opted_out
    finally:
        assert proc.stop() == 0, proc.log()


def test_the_model_drafting_for_itself_is_nearly_always_right_and_changes_nothing(
        plain, tmp_path):
    expected = text(answer(plain))
    proc = daemon(tmp_path, "draft",
                  f'mode = "draft"\ndraft_model_path = "{default_model_path()}"')
    try:
        body = answer(proc)
        assert text(body) == expected
        timings = body["timings"]
        assert timings["draft_n"] > 0
        assert timings["draft_n_accepted"] >= 0.9 * timings["draft_n"], timings
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_draft_model_with_another_vocabulary_stops_the_start(tmp_path, tiny_model_path):
    workdir = tmp_path / "bad"
    workdir.mkdir()
    config = stage_config(lanes=2, ctx_size=2048, socket=str(workdir / "c.sock"),
                          extra=f'[speculative]\nmode = "draft"\n'
                                f'draft_model_path = "{tiny_model_path}"\n')
    proc = ServeProcess(config, workdir)
    assert proc.proc.wait(timeout=120) == ExitCode.STARTUP, proc.log()
    proc.stop()
    assert "speculative.draft_model_path" in proc.log() and "vocabulary" in proc.log()
