"""The prefix cache through the HTTP API: two real SmolLM2 servers, cache on and off.

The cache server has a single lane, so a second conversation takes the lane the first
one's KV stayed in, which pushes the first one out to the host-RAM tier.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_process import ServeProcess

from skippyd.engine.prefix_cache import common_prefix_length
from skippyd.engine.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.model

SYSTEM = ("You are a geography tutor. Answer every question with the name of one city and "
          "nothing else. Keep answers short, factual and in English. Never explain, never add "
          "punctuation beyond what the name needs, and never apologise. The student is "
          "preparing for a quiz about the capitals of European countries.")


def config(stage_id: str, workdir, kv_cache: str, lanes: int) -> str:
    return f"""
[stage]
id = "{stage_id}"

[runtime]
ctx_size = 2048
lane_count = {lanes}
threads = 1
threads_batch = 1

[http]
listen = "127.0.0.1:0"

[control]
socket = "{workdir / 'control.sock'}"

[kv_cache]
{kv_cache}
"""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    on_dir, off_dir = tmp_path_factory.mktemp("on"), tmp_path_factory.mktemp("off")
    on = ServeProcess(config("cache-on", on_dir, 'mode = "auto"', lanes=1), on_dir)
    off = ServeProcess(config("cache-off", off_dir, 'mode = "disabled"', lanes=2), off_dir)
    try:
        yield on.wait_ready(), off.wait_ready()
    finally:
        on.stop()
        off.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    tok = Tokenizer(smollm2_path)
    yield tok
    tok.close()


def client(server: ServeProcess) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(server: ServeProcess, messages: list[dict], max_tokens: int):
    response = client(server).chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0)
    return response


def prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """The server's chat tokenization (StageEngine.tokenize_chat)."""
    text = tokenizer.render_chat(messages)
    bos = tokenizer.detokenize([tokenizer.bos_token_id]) if tokenizer.add_bos else ""
    add_special = tokenizer.add_bos and not (bos and text.startswith(bos))
    return tokenizer.tokenize(text, add_special=add_special, parse_special=True)


def conversation(question: str, follow_up: str) -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return first, [*first, {"role": "assistant", "content": "{reply}"},
                   {"role": "user", "content": follow_up}]


def second_turn(turn2: list[dict], reply: str) -> list[dict]:
    return [dict(m, content=reply) if m["content"] == "{reply}" else m for m in turn2]


def shared_with_first_turn(tokenizer, first, second, response) -> int:
    """Tokens turn 2 shares with what turn 1 left in the KV (prompt plus decoded reply)."""
    reply = tokenizer.tokenize(response.choices[0].message.content, add_special=False)
    decoded = len(reply) - (response.choices[0].finish_reason == "length")
    history = prompt_ids(tokenizer, first) + reply[:decoded]
    return common_prefix_length(tuple(prompt_ids(tokenizer, second)), tuple(history))


def test_turn_two_reuses_turn_one_and_answers_as_without_the_cache(servers, tokenizer):
    on, off = servers
    first, template = conversation("What is the capital of France?", "And of Italy?")
    replies = [chat(server, first, 8) for server in (on, off)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    second = second_turn(template, replies[0].choices[0].message.content)
    answers = [chat(server, second, 8) for server in (on, off)]
    shared = shared_with_first_turn(tokenizer, first, second, replies[0])
    assert shared > len(prompt_ids(tokenizer, first))  # the reply is reused too
    assert answers[0].usage.prompt_tokens_details.cached_tokens == shared
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_a_conversation_pushed_to_host_ram_comes_back_with_the_same_answer(servers, tokenizer):
    on, off = servers
    first_a, template_a = conversation("What is the capital of Spain?", "And of Portugal?")
    first_b, _ = conversation("What is the capital of Germany?", "And of Austria?")
    reply_a = chat(on, first_a, 8)
    chat(on, first_b, 8)  # takes the only lane: A's entry goes to host RAM
    second_a = second_turn(template_a, reply_a.choices[0].message.content)
    answer_on, answer_off = chat(on, second_a, 8), chat(off, second_a, 8)
    # B only shares the system prompt: a restore this long came from A's host entry.
    shared = shared_with_first_turn(tokenizer, first_a, second_a, reply_a)
    assert answer_on.usage.prompt_tokens_details.cached_tokens == shared
    overlap_b = common_prefix_length(tuple(prompt_ids(tokenizer, second_a)),
                                     tuple(prompt_ids(tokenizer, first_b)))
    assert shared > overlap_b
    assert answer_on.choices[0].message.content == answer_off.choices[0].message.content
