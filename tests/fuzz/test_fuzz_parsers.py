"""Property-based fuzzing of the input parsers: only their own clear error type escapes.

HTTP request bodies (random JSON, mutated valid bodies, unicode, huge numbers) must give
either parameters or an ``ApiError`` with a 4xx status; TOML configs (random tables and
mutated valid files) must give either a config or a ``ConfigError`` naming a key.
"""

from __future__ import annotations

import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippyd.config import ConfigError, example_config_toml, parse_config
from skippyd.http.api_errors import ApiError
from skippyd.http.parsing.request_params import (
    HttpLimits,
    parse_chat_request,
    parse_completion_request,
)

LIMITS = HttpLimits()
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty", "seed",
          "stop", "logit_bias", "ignore_eos", "stream", "stream_options", "n", "logprobs",
          "tools", "echo", "best_of", "suffix", "response_format", "model", "user"]
VALID_COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8, "temperature": 0.5,
                    "stop": ["\n"], "logit_bias": {"5": 1.0}, "stream": True}
VALID_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _check(parse, body) -> None:
    try:
        parse(body, LIMITS, n_vocab=1000)
    except ApiError as exc:
        assert 400 <= exc.status < 500
        assert exc.to_body()["error"]["message"]


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8))
def test_random_completion_bodies(body):
    _check(parse_completion_request, body)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8))
def test_random_chat_bodies(body):
    _check(parse_chat_request, body)


@FUZZ
@given(json_values)
def test_bodies_that_are_not_objects(body):
    _check(parse_completion_request, body)
    _check(parse_chat_request, body)


@FUZZ
@given(st.sampled_from(sorted(VALID_COMPLETION)), json_values)
def test_mutated_valid_completion(field, value):
    _check(parse_completion_request, {**VALID_COMPLETION, field: value})


@FUZZ
@given(st.sampled_from(["role", "content", "name", "extra"]), json_values)
def test_mutated_chat_messages(field, value):
    message = {"role": "user", "content": "hi", field: value}
    _check(parse_chat_request, {**VALID_CHAT, "messages": [message]})


toml_scalars = (st.booleans() | st.integers(min_value=-2**63, max_value=2**63 - 1)
                | st.floats(allow_nan=False) | st.text(max_size=30))
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
SECTIONS = ["stage", "runtime", "http", "control", "telemetry", "kv_cache", "link", "upstream",
            "downstream", "bogus"]
EXAMPLE = tomllib.loads(example_config_toml())
KEYS = sorted({f"{s}.{k}" for s, table in EXAMPLE.items() if isinstance(table, dict) for k in table})


def _check_config(data) -> None:
    try:
        parse_config(data, "<fuzz>")
    except ConfigError as exc:
        assert exc.issues and all(issue.key is not None for issue in exc.issues)
        assert str(exc)


@FUZZ
@given(st.dictionaries(st.sampled_from(SECTIONS),
                       st.dictionaries(st.text(max_size=15), toml_values, max_size=4) | toml_scalars,
                       max_size=4))
def test_random_config_tables(data):
    _check_config(data)


@FUZZ
@given(st.sampled_from(KEYS), toml_values)
def test_mutated_example_config(key, value):
    section, name = key.split(".")
    data = {s: dict(t) if isinstance(t, dict) else t for s, t in EXAMPLE.items()}
    data[section][name] = value
    _check_config(data)
    # Whatever was accepted must dump and load back the same.
    try:
        config = parse_config(data, "<fuzz>")
    except ConfigError:
        return
    from skippyd.config import config_to_toml

    assert parse_config(tomllib.loads(config_to_toml(config))) == config


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_as_a_config_file(tmp_path_factory, raw):
    from skippyd.config import load_config

    path = tmp_path_factory.mktemp("fuzz") / "stage.toml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc)

