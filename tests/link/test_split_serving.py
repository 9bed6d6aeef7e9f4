"""SmolLM2 split into 2 and 3 stage processes behaves like the unsplit server.

Greedy output must be identical bit for bit for requests sent one at a time (same batch
shapes on both sides, and a batch's shape is all that can change a session's numbers),
including a prompt longer than ``n_ubatch``; with requests in flight together the batch
shapes differ, so only prompts with a clear greedy margin are compared. Streaming, stop strings, usage, errors and cancellation go
through stage 0's unchanged HTTP layer and worker.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from link_support import LANES, N_UBATCH, wait_until

pytestmark = pytest.mark.model

LONG_PROMPT = (
    "Water boils at a temperature of one hundred degrees Celsius at sea level, and it "
    "freezes at zero degrees. The three states of water are solid, liquid and gas. Ice "
    "floats because it is less dense than liquid water, which matters for lakes in winter "
    "because the ice on top keeps the water below from freezing. Steam"
)
SEQUENTIAL = ["The capital of France is", "def fibonacci(n):", LONG_PROMPT]
# Prompts whose greedy continuation has a clear margin (sequences, well-known facts).
CONCURRENT = ["1, 2, 3, 4, 5,", "Monday, Tuesday, Wednesday,", "A, B, C, D,",
              "January, February, March,"]


def complete(client, prompt: str, max_tokens: int = 24, **kwargs):
    return client.completions.create(model="any", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kwargs)


@pytest.fixture(params=["chain2", "chain3"])
def chain(request):
    return request.getfixturevalue(request.param)


def test_sequential_greedy_output_is_bit_identical(chain, unsplit_client):
    client = chain.client()
    long_tokens = complete(unsplit_client, LONG_PROMPT, max_tokens=1).usage.prompt_tokens
    assert long_tokens > N_UBATCH
    for prompt in SEQUENTIAL:
        split, whole = complete(client, prompt), complete(unsplit_client, prompt)
        assert split.choices[0].text == whole.choices[0].text, prompt
        assert split.usage == whole.usage
    messages = [{"role": "user", "content": "Name three colours."}]
    split, whole = (c.chat.completions.create(model="any", messages=messages, max_tokens=20,
                                              temperature=0)
                    for c in (client, unsplit_client))
    assert split.choices[0].message.content == whole.choices[0].message.content


def test_requests_in_flight_together_complete_and_match(chain, unsplit_client):
    expected = [complete(unsplit_client, p, max_tokens=16).choices[0].text for p in CONCURRENT]
    client = chain.client()
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        results = list(pool.map(lambda p: complete(client, p, max_tokens=16), CONCURRENT))
    assert [r.choices[0].finish_reason for r in results] == ["length"] * len(CONCURRENT)
    assert [r.choices[0].text for r in results] == expected
    _wait_sessions_freed(chain)


def test_lanes_freed_by_finished_requests_are_reused_at_once(chain2):
    """Twice as many requests as lanes, of different lengths: each new request takes
    the lane a finished one left, on every stage, while the others keep decoding."""
    client = chain2.client()
    lengths = [3, 9, 5, 14, 2, 7, 11, 4]
    with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
        results = list(pool.map(lambda n: complete(client, "1, 2, 3,", max_tokens=n), lengths))
    assert [r.usage.completion_tokens for r in results] == lengths
    _wait_sessions_freed(chain2)


def test_streaming_stop_and_usage_match_unsplit(chain2, unsplit_client):
    def stream(client):
        chunks = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Count from one to ten."}],
            max_tokens=40, temperature=0, stop=[" five"], stream=True,
            stream_options={"include_usage": True})
        pieces, usage, finish = [], None, None
        for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(pieces), usage, finish

    assert stream(chain2.client()) == stream(unsplit_client)


def test_errors_have_the_unsplit_shape(chain2, unsplit_client):
    errors = []
    for client in (chain2.client(), unsplit_client):
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, "Hello", max_tokens=5000)
        errors.append((info.value.status_code, info.value.body))
    assert errors[0] == errors[1]


def _wait_sessions_freed(chain) -> None:
    for i in range(len(chain.stages)):
        wait_until(lambda i=i: chain.status(i)["active_sessions"] == 0, 10,
                   f"stage {i} to free its sessions")


def test_finish_and_cancel_free_every_stage(chain3):
    # NOTE: a stage may have refused stage 0 while the chain started (its own downstream
    # was not listening yet): count only what this test's requests cause.
    rejected_before = [chain3.status(i)["rejected"] for i in range(1, 3)]
    client = chain3.client()
    assert complete(client, "The capital of France is", max_tokens=8).usage.completion_tokens
    stream = client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=400,
                                       temperature=0, stream=True)
    for received, _chunk in enumerate(stream):
        if received == 3:
            break
    # The sequence lives on every stage while it streams...
    assert [chain3.status(i)["active_sessions"] >= 1 for i in range(3)] == [True] * 3
    stream.close()  # the client goes away mid-stream: stage 0 cancels the sequence
    _wait_sessions_freed(chain3)
    statuses = [chain3.status(i) for i in range(3)]
    assert [s["stage_id"] for s in statuses] == ["stage-0", "stage-1", "stage-2"]
    assert statuses[0]["chain"]["num_stages"] == 3 and statuses[0]["chain"]["up"]
    assert [s["rejected"] for s in statuses[1:]] == rejected_before
