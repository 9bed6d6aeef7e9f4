"""Parsing and validation of OpenAI request bodies."""

from __future__ import annotations

from typing import Any

import pytest

from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.http.api_errors import ApiError
from skippyd.http.parsing import unsupported
from skippyd.http.parsing.request_params import (
    DEFAULT_SAMPLING,
    HttpLimits,
    parse_chat_request,
    parse_completion_request,
)

LIMITS = HttpLimits(
    max_body_bytes=10_000,
    max_prompt_tokens=100,
    max_tokens_limit=50,
    max_stop_strings=3,
    max_stop_length=8,
    max_logit_bias=2,
)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def completion(**fields: Any) -> dict[str, Any]:
    return {**COMPLETION, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


def completion_error(body: Any, n_vocab: int | None = 1000) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion_request(body, LIMITS, n_vocab=n_vocab)
    assert info.value.status == 400
    return info.value


def chat_error(body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(body, LIMITS, n_vocab=1000)
    assert info.value.status == 400
    return info.value


# -- happy paths -----------------------------------------------------------------------

def test_defaults_when_only_prompt_given() -> None:
    parsed = parse_completion_request(COMPLETION, LIMITS)
    assert parsed.prompt == "hi"
    assert parsed.params.max_tokens is None
    assert parsed.params.sampling == DEFAULT_SAMPLING
    assert (DEFAULT_SAMPLING.temperature, DEFAULT_SAMPLING.top_k, DEFAULT_SAMPLING.top_p,
            DEFAULT_SAMPLING.min_p) == (0.8, 40, 0.95, 0.05)  # llama-server's
    assert (parsed.params.n, parsed.params.logprobs, parsed.params.echo,
            parsed.params.constraint) == (1, None, False, None)
    assert (parsed.params.stop, parsed.params.stream, parsed.params.include_usage) == (
        (), False, False,
    )


def test_configured_sampling_defaults_fill_what_the_client_leaves_out() -> None:
    defaults = SamplingConfig(temperature=0.2, top_k=5)
    sampling = parse_completion_request(completion(top_k=7), LIMITS,
                                        defaults=defaults).params.sampling
    assert (sampling.temperature, sampling.top_k) == (0.2, 7)


def test_every_sampling_field_reaches_the_config() -> None:
    body = completion(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repeat_penalty=1.1, seed=42, ignore_eos=True,
        logit_bias={"7": 5, "3": -100},
    )
    sampling = parse_completion_request(body, LIMITS, n_vocab=1000).params.sampling
    assert sampling == SamplingConfig(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repeat_penalty=1.1, seed=42, ignore_eos=True,
        logit_bias=((3, -100.0), (7, 5.0)),
    )


def test_seed_minus_one_is_unset_and_top_k_below_one_disables_it() -> None:
    sampling = parse_completion_request(completion(seed=-1, top_k=-1), LIMITS).params.sampling
    assert (sampling.seed, sampling.top_k) == (None, 0)
    sampling = parse_completion_request(completion(typical_p=0.5, repeat_last_n=-1),
                                        LIMITS).params.sampling
    assert (sampling.typical_p, sampling.penalty_last_n) == (0.5, -1)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    parsed = parse_chat_request(chat(max_tokens=10, max_completion_tokens=20), LIMITS)
    assert parsed.params.max_tokens == 20


def test_stop_string_and_list_and_stream_options() -> None:
    single = parse_completion_request(completion(stop="\n"), LIMITS).params
    listed = parse_completion_request(
        completion(stop=["a", "b"], stream=True, stream_options={"include_usage": True}), LIMITS
    ).params
    assert single.stop == ("\n",)
    assert (listed.stop, listed.stream, listed.include_usage) == (("a", "b"), True, True)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [([1, 2, 3], (1, 2, 3)), (["one"], "one"), ([[4, 5]], (4, 5)), ("", "")],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert parse_completion_request({"prompt": prompt}, LIMITS).prompt == expected


def test_chat_content_parts_are_flattened_and_developer_is_system() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    }
    parsed = parse_chat_request(body, LIMITS)
    assert parsed.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    )
    assert "be brief" not in parsed.anon_repr()


@pytest.mark.parametrize(
    "fields",
    [{"n": 1}, {"logprobs": False}, {"tools": []}, {"tool_choice": "none"},
     {"response_format": {"type": "text"}}, {"top_logprobs": 0}, {"user": "u"},
     {"functions": None}, {"modalities": ["text"]}, {"suffix": ""}, {"metadata": {"a": "b"}},
     {"store": False}, {"audio": None}],
)
def test_harmless_values_of_unsupported_options_are_accepted(fields: dict[str, Any]) -> None:
    parse_chat_request(chat(**fields), LIMITS)


# -- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("body", [[], "text", None, 3])
def test_body_must_be_an_object(body: Any) -> None:
    assert "JSON object" in completion_error(body).message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", 0),
        ("max_completion_tokens", -3), ("temperature", "hot"), ("temperature", -0.1),
        ("temperature", True), ("top_p", 1.5), ("top_p", "x"), ("top_k", 2.5), ("top_k", -2),
        ("min_p", -0.1), ("presence_penalty", 3), ("frequency_penalty", -2.5),
        ("repeat_penalty", 0), ("repeat_penalty", "1"), ("seed", "42"), ("seed", 1.0),
        ("seed", -2), ("stream", "yes"), ("ignore_eos", 1), ("model", 5),
        ("stream_options", "usage"), ("stop", 5), ("stop", ["ok", 3]), ("logit_bias", [1, 2]),
        ("n", "2"), ("response_format", "json"), ("typical_p", 2), ("repeat_last_n", -2),
    ],
)
def test_wrong_type_or_range_names_the_field(field: str, value: Any) -> None:
    error = completion_error(completion(**{field: value}))
    assert error.param == field
    assert error.message.startswith(field)


def test_include_usage_must_be_boolean() -> None:
    error = completion_error(completion(stream=True, stream_options={"include_usage": "yes"}))
    assert error.param == "stream_options.include_usage"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (completion(suffix="end"), "suffix"),
        (completion(functions=[{"name": "f"}]), "functions"),
        (completion(function_call="auto"), "function_call"),
        (completion(modalities=["text", "audio"]), "modalities"),
        (completion(min_tokens=3), "min_tokens"),  # without ignore_eos
        (completion(response_format={"type": "xml"}), "response_format.type"),
    ],
)
def test_unsupported_options_are_refused_by_name(body: dict[str, Any], field: str) -> None:
    error = completion_error(body)
    assert error.param == field
    assert error.code == "unsupported_parameter"
    assert "not supported" in error.message


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        (completion(n=0), "n", "[1, 16]"), (completion(n=17), "n", "[1, 16]"),
        (completion(n=2, best_of=3), "best_of", "best_of == n"),
        (completion(logprobs=21), "logprobs", "[0, 20]"),
        (completion(logprobs=True), "logprobs", "integer"),
        (completion(max_tokens=0), "max_tokens", ">= 1"),
        (completion(grammar=""), "grammar", "non-empty"),
        (completion(response_format={"type": "json_schema"}), "response_format.json_schema",
         "object"),
        (completion(response_format={"type": "json_object"}, grammar='root ::= "a"'), "grammar",
         "cannot be combined"),
        (completion(json_schema=[1]), "json_schema", "JSON Schema object"),
    ],
)
def test_new_options_are_checked_by_name(body: dict[str, Any], field: str, fragment: str) -> None:
    error = completion_error(body)
    assert error.param == field
    assert fragment in error.message


def test_completion_options_reach_the_params() -> None:
    params = parse_completion_request(completion(
        n=3, best_of=3, logprobs=2, echo=True, max_tokens=0, grammar='root ::= "a"'),
        LIMITS).params
    assert (params.n, params.logprobs, params.echo, params.max_tokens) == (3, 2, True, 0)
    assert params.constraint.kind == "grammar" and params.constraint.grammar == 'root ::= "a"'


@pytest.mark.parametrize(
    ("response_format", "kind", "schema"),
    [({"type": "json_object"}, "json_object", None),
     ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
      "json_schema", {"type": "integer"}),
     ({"type": "json_object", "schema": {"type": "array"}}, "json_schema", {"type": "array"})],
)
def test_response_formats(response_format: dict, kind: str, schema: Any) -> None:
    constraint = parse_chat_request(chat(response_format=response_format),
                                    LIMITS).params.constraint
    assert (constraint.kind, constraint.schema) == (kind, schema)


def test_chat_logprobs_and_tools_reach_the_params() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    parsed = parse_chat_request(chat(logprobs=True, top_logprobs=3, n=2, tools=tools,
                                     tool_choice="required", parallel_tool_calls=False,
                                     chat_template_kwargs={"enable_thinking": False}), LIMITS)
    assert (parsed.params.logprobs, parsed.params.n) == (3, 2)
    assert parsed.tools.names == ("get_weather",) and parsed.tools.forced
    assert not parsed.tools.parallel
    assert parsed.template_kwargs == {"enable_thinking": False}
    assert parse_chat_request(chat(logprobs=True), LIMITS).params.logprobs == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"top_logprobs": 2}, "top_logprobs"), ({"n": 40}, "n"),
     ({"tools": [{"type": "x"}]}, "tools[0].type"),
     ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
         "type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
     ({"tool_choice": "required"}, "tool_choice"),
     ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
     ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}],
       "response_format": {"type": "json_object"}}, "response_format")],
)
def test_chat_refuses_bad_new_options(fields: dict[str, Any], field: str) -> None:
    assert chat_error(chat(**fields)).param == field


def test_min_tokens_is_honoured_by_ignore_eos() -> None:
    parsed = parse_completion_request(completion(min_tokens=8, ignore_eos=True), LIMITS)
    assert parsed.params.sampling.ignore_eos
    parse_completion_request(completion(min_tokens=0), LIMITS)
    assert completion_error(completion(min_tokens=-1, ignore_eos=True)).param == "min_tokens"


def test_echo_is_a_completions_option() -> None:
    parse_chat_request(chat(echo=True), LIMITS)  # unknown to chat: logged, ignored
    assert parse_completion_request(completion(echo=True), LIMITS).params.echo


def test_unknown_fields_are_logged_once(caplog, monkeypatch) -> None:
    # Earlier tests of the session may have filled the bounded set of names seen.
    monkeypatch.setattr(unsupported, "_unknown_seen", set())
    with caplog.at_level("WARNING", logger="skippyd.http.parsing.unsupported"):
        for _ in range(3):
            parse_completion_request(completion(frobnicate_unknown=1), LIMITS)
    assert [r.getMessage() for r in caplog.records].count(
        "completions request field 'frobnicate_unknown' is unknown to skippyd and is ignored "
        "(logged once per name)") == 1


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        (None, "must be a string"), ([], "non-empty"), (["a", "b"], "batch of 2"),
        ([[1], [2]], "batch of 2"), ([1, "a"], "token ids"), ([1, -1], "outside"),
        ([1, 1000], "outside"), ([True], "token ids"), (5, "must be a string"),
    ],
)
def test_bad_prompts(prompt: Any, fragment: str) -> None:
    error = completion_error({"prompt": prompt})
    assert error.param == "prompt"
    assert fragment in error.message


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (None, "messages"), ([], "messages"), (["hi"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"), ([{"role": 3, "content": "x"}],
                                                    "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}],
         "messages[0].tool_calls[0].function.name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "tool", "content": "x", "tool_call_id": 5}], "messages[0].tool_call_id"),
    ],
)
def test_bad_messages_name_the_path(messages: Any, field: str) -> None:
    assert chat_error({"messages": messages}).param == field


@pytest.mark.parametrize(
    ("fields", "field", "limit"),
    [
        ({"max_tokens": 51}, "max_tokens", "max_tokens_limit=50"),
        ({"max_completion_tokens": 51}, "max_completion_tokens", "max_tokens_limit=50"),
        ({"stop": ["a", "b", "c", "d"]}, "stop", "max_stop_strings=3"),
        ({"stop": "123456789"}, "stop", "max_stop_length=8"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "max_logit_bias=2"),
    ],
)
def test_limits_are_enforced_by_name(fields: dict[str, Any], field: str, limit: str) -> None:
    error = completion_error(completion(**fields))
    assert error.param == field
    assert limit in error.message


def test_limits_at_the_boundary_are_accepted() -> None:
    body = completion(max_tokens=50, stop=["a", "b", "12345678"], logit_bias={"1": 1, "2": 2})
    params = parse_completion_request(body, LIMITS).params
    assert params.max_tokens == 50
    assert len(params.stop) == 3


def test_empty_stop_string_is_refused() -> None:
    assert "empty" in completion_error(completion(stop=["ok", ""])).message


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {" 1": 1}, {"1000": 1}, {"1": "x"}, {"1": 101},
     {"1": True}, {"1": None}],
)
def test_bad_logit_bias_entries(bias: dict[str, Any]) -> None:
    assert completion_error(completion(logit_bias=bias)).param == "logit_bias"


def test_logit_bias_token_range_needs_vocab_only_when_known() -> None:
    params = parse_completion_request(completion(logit_bias={"5000": 1}), LIMITS).params
    assert params.sampling.logit_bias == ((5000, 1.0),)
    assert "below 1000" in completion_error(completion(logit_bias={"5000": 1})).message


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_stop_strings"):
        HttpLimits(max_stop_strings=-1)
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="max_logit_bias"):
        HttpLimits(max_logit_bias=10_000)


def test_zero_stop_strings_or_logit_biases_refuse_the_field() -> None:
    limits = HttpLimits(max_stop_strings=0, max_logit_bias=0)
    with pytest.raises(ApiError, match="max_stop_strings=0") as error:
        parse_completion_request({"prompt": "x", "stop": "a"}, limits)
    assert error.value.param == "stop"
    with pytest.raises(ApiError, match="max_logit_bias=0"):
        parse_completion_request({"prompt": "x", "logit_bias": {"1": 1}}, limits)
    assert parse_completion_request({"prompt": "x"}, limits).params.stop == ()
