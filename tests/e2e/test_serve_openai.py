"""The official openai SDK against a real ``skippyd serve`` process on SmolLM2."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import openai
import pytest
from serve_process import LANES, ServeProcess, stage_config

pytestmark = pytest.mark.model

FACTUAL = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Monday, Tuesday, Wednesday,",
    "The opposite of hot is",
    "January, February, March,",
    "A, B, C, D,",
    "The first letter of the alphabet is",
    "Water is made of hydrogen and",
]


def complete(client, prompt: str, max_tokens: int = 12, **kwargs) -> str:
    response = client.completions.create(model="any", prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, **kwargs)
    return response.choices[0].text


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_chat_completion_non_streaming(client):
    response = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 16
    assert response.usage.prompt_tokens > 5
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=20,
                                           temperature=0)
    stream = client.chat.completions.create(
        model="any", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert finish == whole.choices[0].finish_reason


def test_completion_length_and_streaming(client):
    response = client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=9,
                                         temperature=0)
    assert response.usage.completion_tokens == 9
    assert response.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="1, 2, 3,", max_tokens=9, temperature=0, stream=True))
    assert text == response.choices[0].text
    assert text.startswith(" 4, 5, 6")


def test_stop_strings_are_never_leaked(client):
    full = complete(client, "1, 2, 3,", max_tokens=12)
    assert ", 6" in full
    stopped = client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=12,
                                        temperature=0, stop=[", 6"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(", 6")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=", 6", stream=True))
    assert streamed == stopped.choices[0].text


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model="any", prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="any", prompt="hi", max_tokens=4, n=99)
    with pytest.raises(openai.BadRequestError, match="max_tokens_limit=4096"):
        client.completions.create(model="any", prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="context") as excinfo:
        client.completions.create(model="any", prompt="hello " * 4100, max_tokens=4)
    assert "4096" in str(excinfo.value)  # the 8 lanes share one pool of 4096 KV cells
    response = httpx.post(server.url + "/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"]


#: Largest logprob gap between two candidates that batching may swap (a near-tie).
NEAR_TIE = 0.1


def greedy_steps(choices) -> list[tuple[str, dict[str, float]]]:
    """Each generated token with its top alternatives, from completion choices."""
    steps = []
    for choice in choices:
        logprobs = choice.logprobs
        if logprobs is not None:
            steps.extend(zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    return steps


def test_eight_concurrent_streams_match_solo_runs(client):
    """Batched streams give each prompt its own greedy answer.

    llama.cpp sums a row's attention over however many KV cells the batch spans, so a
    batched row's logits can differ from a solo row's in the last bits; where the two best
    tokens are that close, greedy may take either. The streams must agree with their solo
    runs up to such a near-tie, and there both runs must rank the two tokens within
    NEAR_TIE of each other, which a stream fed another request's rows would not.
    """
    solo = {p: greedy_steps(client.completions.create(
        model="any", prompt=p, max_tokens=12, temperature=0, logprobs=2).choices)
        for p in FACTUAL}

    def stream(prompt: str) -> tuple[list[tuple[str, dict[str, float]]], int]:
        chunks = list(client.completions.create(model="any", prompt=prompt, max_tokens=12,
                                                temperature=0, logprobs=2, stream=True,
                                                stream_options={"include_usage": True}))
        tokens = next(c.usage.completion_tokens for c in chunks if c.usage is not None)
        return greedy_steps(choice for chunk in chunks for choice in chunk.choices), tokens

    with concurrent.futures.ThreadPoolExecutor(len(FACTUAL)) as pool:
        results = dict(zip(FACTUAL, pool.map(stream, FACTUAL), strict=True))
    departures = 0
    for prompt, (steps, tokens) in results.items():
        assert tokens == 12 and len(steps) == 12 and len(solo[prompt]) == 12, prompt
        for (token, top), (solo_token, solo_top) in zip(steps, solo[prompt], strict=True):
            if token == solo_token:
                continue
            departures += 1
            assert abs(solo_top[solo_token] - solo_top.get(token, float("-inf"))) < NEAR_TIE, (
                prompt, token, solo_token, solo_top)
            assert abs(top[token] - top.get(solo_token, float("-inf"))) < NEAR_TIE, (
                prompt, token, solo_token, top)
            break  # past a near-tie the two answers continue different texts
    assert departures <= 2, results  # near-ties are rare; most answers match exactly


def test_disconnect_mid_stream_frees_the_lane(client, server):
    # Open LANES streams and drop each after its first token.
    got_token = threading.Barrier(LANES + 1, timeout=120)

    def open_and_drop(i: int) -> None:
        with httpx.stream("POST", server.url + "/completions", timeout=120, json={
            "prompt": f"Count slowly to one hundred, attempt {i}:", "max_tokens": 2000,
            "stream": True, "ignore_eos": True,
        }) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
        got_token.wait()

    threads = [threading.Thread(target=open_and_drop, args=(i,)) for i in range(LANES)]
    for t in threads:
        t.start()
    got_token.wait()
    for t in threads:
        t.join(timeout=60)
    # Every lane must be free again: a burst of LANES requests completes without a 429.
    with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
        texts = list(pool.map(lambda p: complete(client, p, max_tokens=4), FACTUAL[:LANES]))
    assert all(texts)


def test_overload_gets_429_with_retry_after(tmp_path):
    proc = ServeProcess(stage_config(lanes=1, queue_capacity=1, ctx_size=1024), tmp_path)
    try:
        proc.wait_ready()
        body = {"prompt": "Tell me a long story.", "max_tokens": 48, "ignore_eos": True}

        def post(_):
            return httpx.post(proc.url + "/completions", json=body, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(post, range(12)))
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes
        assert set(codes) <= {200, 429}
        rejected = next(r for r in responses if r.status_code == 429)
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["message"]
        # Nothing hangs and the server still serves afterwards.
        assert httpx.post(proc.url + "/completions", json=body, timeout=120).status_code == 200
    finally:
        assert proc.stop() == 0
