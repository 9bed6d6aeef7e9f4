"""Parsing and validation of OpenAI request bodies."""

from __future__ import annotations

from typing import Any

import pytest

from skippyd.engine.runtime.protocol import SamplingConfig
from skippyd.http.errors import ApiError
from skippyd.http.requests import (
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
    assert parsed.params.sampling == SamplingConfig()
    assert (parsed.params.stop, parsed.params.stream, parsed.params.include_usage) == (
        (), False, False,
    )


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


def test_seed_minus_one_and_top_k_minus_one_mean_unset() -> None:
    sampling = parse_completion_request(completion(seed=-1, top_k=-1), LIMITS).params.sampling
    assert (sampling.seed, sampling.top_k) == (None, 0)


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
     {"response_format": {"type": "text"}}, {"top_logprobs": 0}, {"user": "u"}],
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
        ("n", "2"), ("response_format", "json"),
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
        (completion(n=2), "n"), (completion(best_of=3), "best_of"),
        (completion(logprobs=0), "logprobs"), (completion(echo=True), "echo"),
        (completion(suffix="end"), "suffix"),
        (completion(tools=[{"type": "function"}]), "tools"),
        (completion(functions=[{"name": "f"}]), "functions"),
        (completion(tool_choice="auto"), "tool_choice"),
        (completion(function_call="auto"), "function_call"),
        (completion(response_format={"type": "json_object"}), "response_format"),
        (completion(top_logprobs=2), "top_logprobs"),
    ],
)
def test_unsupported_options_are_refused_by_name(body: dict[str, Any], field: str) -> None:
    error = completion_error(body)
    assert error.param == field
    assert error.code == "unsupported_parameter"
    assert "not supported" in error.message


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"logprobs": True}, "logprobs"), ({"n": 4}, "n"), ({"tools": [{"type": "x"}]}, "tools")],
)
def test_chat_refuses_unsupported_options(fields: dict[str, Any], field: str) -> None:
    assert chat_error(chat(**fields)).param == field


def test_chat_ignores_completion_only_fields_but_completion_refuses_echo() -> None:
    parse_chat_request(chat(echo=True), LIMITS)
    assert completion_error(completion(echo=True)).param == "echo"


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
         "messages[0].tool_calls"),
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
