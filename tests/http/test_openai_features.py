"""Structured output, tools, logprobs, choices and the utility endpoints, over the fake
backend (its tokens are bytes: token = byte + 1, so texts and token ids map 1:1)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import byte_tokens
from starlette.testclient import TestClient
from test_openai_app import CHAT_URL, COMPLETIONS_URL, assert_error, stream

from skippyd.http.api.routes import create_app
from skippyd.http.parsing.request_params import HttpLimits

# Byte tokens: a tool list in a system message takes a few hundred of them.
LIMITS = HttpLimits(max_body_bytes=16384, max_prompt_tokens=2000, max_tokens_limit=512)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def client(fake: Any) -> Iterator[TestClient]:
    fake.ctx_size = 4096
    with TestClient(create_app(fake, limits=LIMITS, default_max_tokens=256)) as test_client:
        yield test_client


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **fields}


# -- constrained output ----------------------------------------------------------------

def test_a_json_schema_becomes_the_grammar_of_the_request(client: TestClient, fake: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response = client.post(CHAT_URL, json=chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert response.status_code == 200
    grammar = fake.only_generation().request.sampling.grammar
    assert grammar == f"root ::= call\ncall ::= {json.dumps(json.dumps(schema))}"


def test_a_gbnf_grammar_is_checked_and_used(client: TestClient, fake: Any) -> None:
    assert client.post(COMPLETIONS_URL, json={"prompt": "x", "grammar": 'root ::= "a"'}
                       ).status_code == 200
    assert fake.only_generation().request.sampling.grammar == 'root ::= "a"'
    error = assert_error(client.post(COMPLETIONS_URL, json={"prompt": "x", "grammar": "nope"}),
                         400, "grammar")
    assert "could not parse" in error["message"]


def test_an_unenforceable_schema_keyword_is_named(client: TestClient, fake: Any) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}
    response = client.post(COMPLETIONS_URL, json={"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}})
    error = assert_error(response, 400,
                         "response_format.json_schema.schema.properties.age.minimum")
    assert "'minimum' is not supported" in error["message"]
    assert fake.generations == {}


def test_a_split_stage_refuses_what_needs_local_sampling(client: TestClient, fake: Any) -> None:
    fake.local_sampling = False
    for body, param in ((chat(logprobs=True), "logprobs"),
                        (chat(response_format={"type": "json_object"}), "response_format"),
                        (chat(tools=TOOLS, tool_choice="required"), "tool_choice")):
        assert "split pipeline" in assert_error(client.post(CHAT_URL, json=body), 400,
                                                param)["message"]
    assert client.post(CHAT_URL, json=chat(tools=TOOLS)).status_code == 200


# -- tools -----------------------------------------------------------------------------

def test_a_tool_call_reply(client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens(CALL)
    body = client.post(CHAT_URL, json=chat(tools=TOOLS)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # SmolLM-like templates know no tools: they came as a system message.
    assert fake.rendered[-1][0]["role"] == "system"
    assert "get_weather" in fake.rendered[-1][0]["content"]


def test_tool_calls_stream_as_deltas(client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens("Sure." + CALL)
    chunks = stream(client, CHAT_URL, chat(tools=TOOLS))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)


def test_a_forced_call_gets_a_grammar_and_tool_messages_reach_the_template(
        client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens(CALL)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    response = client.post(CHAT_URL, json={"messages": messages, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert response.json()["choices"][0]["finish_reason"] == "tool_calls"
    grammar = fake.only_generation().request.sampling.grammar
    assert grammar.startswith('root ::= "<tool_call>\\n" call "\\n</tool_call>"')
    assert '\\"const\\": \\"get_weather\\"' in grammar  # the fake quotes the schema
    rendered = fake.rendered[-1]
    assert rendered[-1] == {"role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
    assert '"arguments": {"city": "Oslo"}' in rendered[-2]["content"]


def test_tools_reach_a_template_that_knows_them(client: TestClient, fake: Any) -> None:
    fake.chat_template = "{% for t in tools %}<tool_call>{{ t }}{% endfor %}"
    client.post(CHAT_URL, json=chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False}))
    call = fake.render_calls[-1]
    assert call["tools"] == [{"type": "function", "function": TOOLS[0]["function"]}]
    assert call["template_kwargs"] == {"enable_thinking": False}
    assert fake.rendered[-1] == [{"role": "user", "content": "hi"}]


def test_a_template_that_refuses_tools_is_a_400_naming_tools_not_messages(
        client: TestClient, fake: Any) -> None:
    fake.chat_template = "{% for t in tools %}<tool_call>{{ t }}{% endfor %}"
    fake.refuses_tools = True
    response = client.post(CHAT_URL, json=chat(tools=TOOLS))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert "this template takes no tools" in error["message"]
    assert not fake.generations
    bad_turns = client.post(CHAT_URL, json={"messages": [{"role": "bad", "content": "x"}],
                                            "tools": TOOLS})
    assert bad_turns.status_code == 400
    assert bad_turns.json()["error"]["param"] == "messages"


# -- reasoning -------------------------------------------------------------------------

def test_think_text_is_reasoning_content(client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens("<think>hmm</think>\n\nParis.")
    message = client.post(CHAT_URL, json=chat()).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm", "Paris.")
    chunks = stream(client, CHAT_URL, chat())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."


def test_a_template_that_opens_think_starts_the_reply_in_reasoning(
        client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens("hmm</think>Paris.")
    message = client.post(CHAT_URL, json=chat(chat_template_kwargs={"opening": "<think>\n"})
                          ).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm", "Paris.")


def test_reasoning_can_be_left_in_the_content(fake: Any) -> None:
    fake.script = byte_tokens("<think>hmm</think>Paris.")
    with TestClient(create_app(fake, limits=LIMITS, reasoning=False)) as client:
        message = client.post(CHAT_URL, json=chat()).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>hmm</think>Paris."}


# -- logprobs --------------------------------------------------------------------------

def test_chat_logprobs_streaming_and_not(client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens("Hi!")
    body = client.post(CHAT_URL, json=chat(logprobs=True, top_logprobs=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["H", "i", "!"]
    assert content[0] == {"token": "H", "logprob": -0.25, "bytes": [72], "top_logprobs": [
        {"token": "H", "logprob": -0.25, "bytes": [72]},
        {"token": "I", "logprob": -0.5, "bytes": [73]}]}
    assert fake.generations[body["id"]].request.sampling.logprobs == 2
    streamed = [e for c in stream(client, CHAT_URL, chat(logprobs=True))
                for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == ["H", "i", "!"]


def test_completion_logprobs_with_echo(client: TestClient, fake: Any) -> None:
    fake.script = byte_tokens("ok")
    body = client.post(COMPLETIONS_URL, json={"prompt": "ab", "echo": True, "logprobs": 1,
                                              "max_tokens": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == "abok"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["", "a", "b", "o", "k"]  # BOS renders as nothing
    assert logprobs["token_logprobs"] == [None, -0.25, -0.25, -0.25, -0.25]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"a": -0.25}
    assert logprobs["text_offset"] == [0, 0, 1, 2, 3]
    request = fake.only_generation().request
    assert (request.sampling.logprobs, request.sampling.prompt_logprobs) == (1, 1)


def test_echo_scoring_without_generating(client: TestClient, fake: Any) -> None:
    body = client.post(COMPLETIONS_URL, json={"prompt": "ab", "echo": True, "logprobs": 0,
                                              "max_tokens": 0}).json()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "length")
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -0.25]
    assert body["usage"]["completion_tokens"] == 0
    chunks = stream(client, COMPLETIONS_URL, {"prompt": "ab", "echo": True, "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"


# -- n choices -------------------------------------------------------------------------

def test_n_choices_share_the_prompt_and_get_their_own_seeds(client: TestClient,
                                                            fake: Any) -> None:
    body = client.post(COMPLETIONS_URL, json={"prompt": "x", "n": 3, "seed": 10,
                                              "max_tokens": 5}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "Hello" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 15, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    requests = {g.request.request_id: g.request for g in fake.generations.values()}
    lead = body["id"]
    assert requests[lead].fork_of is None and requests[lead].sampling.seed == 10
    assert [(requests[f"{lead}-{i}"].fork_of, requests[f"{lead}-{i}"].sampling.seed)
            for i in (1, 2)] == [(lead, 11), (lead, 12)]


def test_n_choices_stream_interleaved_each_with_its_end(client: TestClient, fake: Any) -> None:
    chunks = stream(client, CHAT_URL, chat(n=2, max_tokens=4,
                                           stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hell", 1: "Hell"} and finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_more_choices_than_lanes_are_refused(client: TestClient, fake: Any) -> None:
    error = assert_error(client.post(COMPLETIONS_URL, json={"prompt": "x", "n": 5}), 400, "n")
    assert "4 lanes" in error["message"]
    assert fake.generations == {}


def test_a_refused_later_choice_cancels_the_earlier_ones(client: TestClient, fake: Any) -> None:
    original = fake.submit

    def submit(request, on_event):
        if request.fork_of is not None:
            fake.queue_full = True
        original(request, on_event)

    fake.submit = submit
    response = client.post(COMPLETIONS_URL, json={"prompt": "x", "n": 3})
    assert response.status_code == 429
    assert fake.cancel_calls == [next(iter(fake.generations))]


# -- utility endpoints -----------------------------------------------------------------

def test_tokenize_detokenize_apply_template_props_and_models(client: TestClient) -> None:
    assert client.post("/tokenize", json={"content": "ab"}).json() == {"tokens": [98, 99]}
    assert client.post("/tokenize", json={"content": "a", "add_special": True,
                                          "with_pieces": True}).json() == {
        "tokens": [{"id": 0, "piece": ""}, {"id": 98, "piece": "a"}]}
    assert client.post("/detokenize", json={"tokens": [98, 99]}).json() == {"content": "ab"}
    assert_error(client.post("/detokenize", json={"tokens": [1, 999]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={"text": "x"}), 400, "content")
    assert client.post("/tokenize", json={"content": "<s>a"}).json()["tokens"][0] != 0
    assert client.post("/tokenize", json={"content": "<s>a", "parse_special": True}).json() == {
        "tokens": [0, 98]}
    assert_error(client.post("/tokenize", json={"content": "a", "parse_special": 1}), 400,
                 "parse_special")
    prompt = client.post("/apply-template", json=chat("yo")).json()["prompt"]
    assert prompt == "<user>yo\n<assistant>"
    props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert (props["total_slots"], props["layer_start"], props["layer_end"]) == (4, 0, 30)
    (model,) = client.get("/v1/models").json()["data"]
    assert model["max_model_len"] == 4096
    assert model["meta"] == {"n_ctx": 4096, "layer_start": 0, "layer_end": 30, "n_layer": 30}


# -- where texts are tokenized -----------------------------------------------------------

def test_short_texts_are_tokenized_on_the_event_loop_and_long_ones_on_the_text_pool(
        fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    tokenize = fake.tokenize

    def recording(text: str, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return tokenize(text, **kwargs)

    monkeypatch.setattr(fake, "tokenize", recording)
    fake.ctx_size = 8192
    limits = HttpLimits(max_body_bytes=16384, max_prompt_tokens=4000, max_tokens_limit=64)
    long = "word " * 420  # 2100 characters: over INLINE_TEXT_CHARS
    with TestClient(create_app(fake, limits=limits)) as client:
        for url, body in ((COMPLETIONS_URL, {"prompt": "Say"}), (CHAT_URL, chat("hi")),
                          (COMPLETIONS_URL, {"prompt": long}), (CHAT_URL, chat(long))):
            assert client.post(url, json={**body, "max_tokens": 4}).status_code == 200
    short_completion, short_chat, long_completion, long_chat = threads
    assert not short_completion.startswith("skippyd-text")
    assert short_chat == short_completion  # the loop's own thread
    assert long_completion.startswith("skippyd-text") and long_chat.startswith("skippyd-text")


def test_speculative_decoding_is_reported_in_usage_and_timings(client: TestClient,
                                                                fake: Any) -> None:
    fake.drafts = (12, 9)
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert body["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 9, "rejected_prediction_tokens": 3}
    assert body["timings"] == {"draft_n": 12, "draft_n_accepted": 9}
    with client.stream("POST", "/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["timings"] == {"draft_n": 12, "draft_n_accepted": 9}
    fake.drafts = (0, 0)
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).json()
    assert "timings" not in plain and "completion_tokens_details" not in plain["usage"]


def test_a_request_may_keep_speculation_off(client: TestClient, fake: Any) -> None:
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2,
                                         "speculative": False})
    assert [g.request.speculative for g in fake.generations.values()] == [True, False]
    refused = client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2,
                                                   "speculative": "no"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculative"
