"""Speculative decoding across a split: stage 0 drafts, the final stage verifies.

A request's drafts travel down the chain as extra rows of its entry; the final stage
keeps those its own sampling confirms and returns them with the next token, and every
stage drops the rejected rows from its KV (stage 0 when the result arrives, the others
when the session's next entry starts earlier). Greedy answers are compared with the
unsplit server's without drafts, on a prompt the model copies (a list it is told to
repeat): there the best token leads by far, so the other batch shapes of verification
cannot flip one.
"""

from __future__ import annotations

import json

import httpx
import pytest
from link_support import Chain, wait_until

pytestmark = pytest.mark.model

COPY = [{"role": "user", "content":
         "Repeat this list exactly, one item per line: apple, river, candle, mountain, "
         "violin, harbour, lantern, meadow, copper, falcon, apple, river, candle, "
         "mountain, violin, harbour, lantern, meadow, copper, falcon."}]


class DraftingChain(Chain):
    """A chain whose stage 0 drafts with n-grams."""

    def config(self, i: int) -> str:
        text = super().config(i)
        return text + '[speculative]\nmode = "ngram"\n' if i == 0 else text


@pytest.fixture(scope="module")
def drafting_chain(tmp_path_factory, slice_dir):
    chain = DraftingChain((0, 10, 20, 30), tmp_path_factory.mktemp("drafting"), slice_dir)
    try:
        yield chain.start()
    finally:
        chain.stop()


def answer(base_url: str, **extra) -> dict:
    response = httpx.post(base_url + "/v1/chat/completions", timeout=180, json={
        "model": "m", "messages": COPY, "max_tokens": 80, "temperature": 0, **extra})
    response.raise_for_status()
    return response.json()


def test_drafts_verified_down_the_chain_give_the_unsplit_answer(drafting_chain, unsplit):
    expected = answer(unsplit.base_url)["choices"][0]["message"]["content"]
    body = answer(drafting_chain.head.base_url)
    assert body["choices"][0]["message"]["content"] == expected
    details = body["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 10
    assert body["timings"]["draft_n"] >= body["timings"]["draft_n_accepted"] > 10
    # Twice in a row: what the rejected drafts left on any stage would show now.
    again = answer(drafting_chain.head.base_url)
    assert again["choices"][0]["message"]["content"] == expected
    streamed = httpx.post(drafting_chain.head.base_url + "/v1/chat/completions",
                          timeout=180, json={"model": "m", "messages": COPY,
                                             "max_tokens": 80, "temperature": 0,
                                             "stream": True})
    text = "".join(_deltas(streamed.text))
    assert text == expected


def test_a_request_that_opts_out_is_served_plainly_on_the_chain(drafting_chain, unsplit):
    expected = answer(unsplit.base_url)["choices"][0]["message"]["content"]
    body = answer(drafting_chain.head.base_url, speculative=False)
    assert body["choices"][0]["message"]["content"] == expected
    assert "timings" not in body


def test_every_stage_frees_the_sessions_afterwards(drafting_chain):
    answer(drafting_chain.head.base_url, max_tokens=40)
    for i in range(3):
        wait_until(lambda i=i: drafting_chain.status(i)["active_sessions"] == 0, 10,
                   f"stage {i} to free every session")


def _deltas(sse: str) -> list[str]:
    out = []
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0]["delta"].get("content"):
                out.append(choice[0]["delta"]["content"])
    return out
