"""The API real clients need, end to end: the official openai SDK against a real
``skippyd serve`` on SmolLM2, each feature streamed and not, and mixed into one batch
with plain requests."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pydantic
import pytest
from openai import OpenAI
from serve_process import ServeProcess, stage_config

pytestmark = pytest.mark.model

PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int
    kind: str = pydantic.Field(json_schema_extra={"enum": ["dog", "cat"]})


def chat_stream(client, **kwargs) -> tuple[list, str | None]:
    """(deltas of choice 0, its finish reason) of a streamed chat completion."""
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model="any", stream=True, **kwargs):
        for choice in chunk.choices:
            deltas.append(choice.delta)
            finish = choice.finish_reason or finish
    return deltas, finish


# -- structured output -------------------------------------------------------------------

def test_json_schema_output_parses_streamed_or_not(client):
    kwargs = dict(messages=[{"role": "user", "content": "Describe my dog Rex, aged 3."}],
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "pet", "schema": PET_SCHEMA}},
                  max_tokens=80, temperature=0)
    whole = client.chat.completions.create(model="any", **kwargs)
    assert whole.choices[0].finish_reason == "stop"
    pet = json.loads(whole.choices[0].message.content)
    assert set(pet) == {"name", "age"} and isinstance(pet["age"], int) and len(pet["name"]) <= 16
    deltas, finish = chat_stream(client, **kwargs)
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert finish == "stop"


def test_json_object_with_sampling(client):
    response = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "A JSON object about a cat."}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=1.0, seed=4)
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


def test_the_sdk_parse_helper_returns_the_model(client):
    completion = client.chat.completions.parse(
        model="any", messages=[{"role": "user", "content": "Describe my pet dog Rex, aged 3."}],
        response_format=Pet, max_tokens=100, temperature=0)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("dog", "cat") and len(pet.name) <= 16


def test_a_gbnf_grammar_on_completions_streamed_or_not(client):
    grammar = 'root ::= (" " [a-z]{1,8} ","){1,3} " blue."'
    whole = client.completions.create(model="any", prompt="Colours: red,", max_tokens=40,
                                      temperature=0, extra_body={"grammar": grammar})
    text = whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop" and text.endswith(" blue.")
    assert all(word.strip().isalpha() for word in text[:-len(" blue.")].split(",") if word)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="Colours: red,", max_tokens=40, temperature=0, stream=True,
        extra_body={"grammar": grammar}))
    assert streamed == text


def test_unenforceable_schemas_and_bad_grammars_are_400(client):
    with pytest.raises(openai.BadRequestError, match="'minimum' is not supported") as info:
        client.chat.completions.create(model="any", messages=ASK_WEATHER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}})
    assert info.value.body["param"] == "response_format.json_schema.schema.properties.n.minimum"
    with pytest.raises(openai.BadRequestError, match="grammar"):
        client.completions.create(model="any", prompt="x", extra_body={"grammar": "root ::= ("})


# -- tool calls --------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_always_valid(client, tool_choice):
    response = client.chat.completions.create(
        model="any", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice,
        max_tokens=60, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_tool_calls_stream_as_deltas(client):
    deltas, finish = chat_stream(client, messages=ASK_WEATHER, tools=[WEATHER],
                                 tool_choice="required", max_tokens=60, temperature=0,
                                 parallel_tool_calls=False)
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    assert not "".join(d.content or "" for d in deltas)


def test_a_tool_result_in_the_conversation_gets_a_text_answer(client, server):
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    response = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER],
                                              tool_choice="none", max_tokens=30, temperature=0)
    assert response.choices[0].message.content and not response.choices[0].message.tool_calls
    prompt = httpx.post(server.base_url + "/apply-template",
                        json={"messages": messages, "tools": [WEATHER]}).json()["prompt"]
    assert "21 C and sunny" in prompt and "get_weather" in prompt


# -- logprobs ----------------------------------------------------------------------------

def test_chat_logprobs_streamed_or_not(client):
    kwargs = dict(messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(model="any", **kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    for entry in content:  # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
    streamed = [entry for chunk in client.chat.completions.create(model="any", stream=True,
                                                                   **kwargs)
                for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completion_echo_scores_the_prompt(client):
    scored = client.completions.create(model="any", prompt="The capital of France is Paris",
                                       echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == "The capital of France is Paris"
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == scored.usage.prompt_tokens
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    # "Paris" after "The capital of France is" is far likelier than "Rome".
    rome = client.completions.create(model="any", prompt="The capital of France is Rome",
                                     echo=True, logprobs=0, max_tokens=0)
    assert choice.logprobs.token_logprobs[-1] > rome.choices[0].logprobs.token_logprobs[-1]
    streamed = list(client.completions.create(model="any", prompt="The capital of France is",
                                              echo=True, logprobs=1, max_tokens=3,
                                              temperature=0, stream=True))
    assert streamed[0].choices[0].text == "The capital of France is"
    assert streamed[0].choices[0].logprobs.token_logprobs[0] is None


# -- n choices ---------------------------------------------------------------------------

def seeded_choices(client):
    response = client.completions.create(model="any", prompt="Once upon a time", n=3,
                                         max_tokens=12, temperature=1.0, seed=21)
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)], response.usage


def test_n_choices_sample_each_on_its_own(client):
    texts, usage = seeded_choices(client)
    assert len(set(texts)) > 1, "each choice samples on its own"
    assert usage.completion_tokens == 3 * 12 and usage.prompt_tokens < 12


def test_n_choices_are_reproducible_with_a_seed_with_a_stream_per_lane(tmp_path):
    # In one shared pool a request's cells land wherever the pool has room, and the
    # order of the sums over them moves the last bits of the logits: a seeded request
    # repeats exactly only with a KV stream per lane (README, "Several choices").
    proc = ServeProcess(stage_config(lanes=4, ctx_size=2048, kv_layout="per_lane"), tmp_path)
    try:
        client = OpenAI(base_url=proc.wait_ready().url, api_key="unused", max_retries=0)
        first, _ = seeded_choices(client)
        client.completions.create(model="any", prompt="Something else entirely", n=2,
                                  max_tokens=20, temperature=1.0)
        assert seeded_choices(client)[0] == first
    finally:
        proc.stop()


def test_n_choices_stream_with_their_indexes(client):
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Name a fruit."}], n=3,
            max_tokens=8, temperature=1.0, seed=5, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == sorted(finishes) == [0, 1, 2]
    assert all(texts.values())


# -- defaults, utility endpoints ---------------------------------------------------------

def test_without_max_tokens_generation_runs_to_its_end(client):
    response = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Say hello."}], temperature=0)
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens > 0
    assert getattr(response.usage, "max_tokens_clamped", None) is None


def test_a_max_tokens_beyond_the_context_is_clamped_and_reported(client):
    response = client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=4090,
                                         temperature=0, stop=[", 9"])
    clamped = response.usage.model_extra["max_tokens_clamped"]
    # The 8 lanes share one pool of 4096 KV cells: one request may fill all of it.
    assert clamped == {"requested": 4090, "granted": 4096 - response.usage.prompt_tokens}


def test_utility_endpoints(server):
    base = server.base_url
    tokens = httpx.post(base + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert len(tokens) == 2
    assert httpx.post(base + "/detokenize", json={"tokens": tokens}).json() == {
        "content": "Hello world"}
    pieces = httpx.post(base + "/tokenize", json={"content": "Hello world",
                                                  "with_pieces": True}).json()["tokens"]
    assert [p["piece"] for p in pieces] == ["Hello", " world"]
    # Control-token text is text unless parse_special asks (as completions prompts are).
    as_text = httpx.post(base + "/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]
    parsed = httpx.post(base + "/tokenize", json={"content": "<|im_start|>",
                                                  "parse_special": True}).json()["tokens"]
    assert len(parsed) == 1 and len(as_text) > 1
    prompt = httpx.post(base + "/apply-template", json={
        "messages": [{"role": "user", "content": "hi"}]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    props = httpx.get(base + "/props").json()
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] == 4096
    assert (props["layer_start"], props["layer_end"]) == (0, 30)
    model = httpx.get(server.url + "/models").json()["data"][0]
    assert model["meta"]["layer_end"] == 30 and model["max_model_len"] == 4096


# -- one batch, no cross-talk -----------------------------------------------------------

def test_plain_greedy_output_is_the_same_beside_every_feature(client):
    """A plain greedy request gives its solo text while constrained, tool, logprob and
    n>1 requests share its batches (prompts with a clear greedy margin).

    A batch's shape changes llama.cpp's arithmetic in the last bits, which flips a near
    tie: "Monday, Tuesday, Wednesday," continues " and Thursday) to create a 3-day" and
    then "weekend" or "cycle" by a hair. Eight tokens stay clear of it; cross-talk between
    requests would show in the first of them."""
    def plain(prompt):
        return client.completions.create(model="any", prompt=prompt, max_tokens=8,
                                         temperature=0).choices[0].text

    def constrained():
        text = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "My dog Rex is 3."}],
            max_tokens=80, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": PET_SCHEMA}},
        ).choices[0].message.content
        assert set(json.loads(text)) == {"name", "age"}

    def tool_call():
        (call,) = client.chat.completions.create(
            model="any", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, temperature=0.7,
        ).choices[0].message.tool_calls
        assert call.function.name == "get_weather"

    def with_logprobs():
        response = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
            logprobs=True, top_logprobs=2, stream=True)
        assert sum(len(c.choices[0].logprobs.content) for c in response
                   if c.choices and c.choices[0].logprobs) > 0

    def choices():
        response = client.completions.create(model="any", prompt="Once upon a time", n=3,
                                             max_tokens=16, temperature=1.0)
        assert len(response.choices) == 3

    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "Monday, Tuesday, Wednesday,"]
    solo = {p: plain(p) for p in prompts}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(n) for n in (constrained, tool_call, with_logprobs, choices)]
        mixed = {p: pool.submit(plain, p) for p in prompts}
        assert {p: f.result() for p, f in mixed.items()} == solo
        for future in busy:
            future.result()


# -- a thinking model's template ---------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
ANSWER = 'root ::= "Paris is the capital." "</think>" "\\n\\nParis."'


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("thinking")
    template = workdir / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    proc = ServeProcess(stage_config(lanes=2, socket=str(workdir / "c.sock")), workdir,
                        extra_args=("--chat-template-file", str(template)))
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.stop()


def test_reasoning_comes_apart_from_the_content(thinking_client):
    kwargs = dict(messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=40,
                  temperature=0, extra_body={"grammar": ANSWER})
    message = thinking_client.chat.completions.create(model="any", **kwargs).choices[0].message
    assert message.model_extra["reasoning_content"] == "Paris is the capital."
    assert message.content == "Paris."
    deltas, _ = chat_stream(thinking_client, **kwargs)
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == (
        "Paris is the capital.")
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_chat_template_kwargs_reach_the_template(thinking_client):
    response = thinking_client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Capital of France?"}],
        max_tokens=20, temperature=0,
        extra_body={"grammar": 'root ::= "Paris."', "chat_template_kwargs": {
            "enable_thinking": False}})
    message = response.choices[0].message
    assert message.content == "Paris." and not message.model_extra.get("reasoning_content")
