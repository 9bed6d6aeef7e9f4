"""Workload parsing and prompt generation (pure functions, no server)."""

from __future__ import annotations

import pytest

from skippyd.bench.workload import (
    IntRange,
    WorkloadError,
    WorkloadSpec,
    build_level,
    parse_concurrency,
    parse_range,
    shared_prefix,
)


def make_spec(**overrides) -> WorkloadSpec:
    values = {"concurrency": (1, 4), "num_requests": 20, "prompt_words": IntRange(10, 30),
              "output_tokens": IntRange(4, 9)}
    return WorkloadSpec(**{**values, **overrides})


def test_parse_range_accepts_fixed_values_and_ranges():
    assert parse_range("64", "--x") == IntRange(64, 64)
    assert parse_range(" 32:96 ", "--x") == IntRange(32, 96)
    assert str(parse_range("32:96", "--x")) == "32:96"


@pytest.mark.parametrize("text", ["", "a", "1:2:3", "9:3", "0", "-4", "3:"])
def test_parse_range_rejects_with_the_option_name(text):
    with pytest.raises(WorkloadError, match="^--output-tokens: "):
        parse_range(text, "--output-tokens")


def test_parse_concurrency():
    assert parse_concurrency("1,4,8") == (1, 4, 8)
    for bad in ("", "1,,4", "0", "2,x", "-1"):
        with pytest.raises(WorkloadError, match="--concurrency"):
            parse_concurrency(bad)


def test_spec_rejects_inconsistent_options():
    with pytest.raises(WorkloadError, match="--shared-prefix"):
        make_spec(shared_prefix_words=10)
    with pytest.raises(WorkloadError, match="--rate"):
        make_spec(rate=0.0)
    with pytest.raises(WorkloadError, match="--requests"):
        make_spec(num_requests=0)


def test_levels_have_unique_prompts_within_the_asked_lengths():
    spec = make_spec()
    levels = [build_level(spec, i) for i in range(len(spec.concurrency))]
    prompts = [r.prompt for level in levels for r in level]
    assert len(set(prompts)) == len(prompts) == 2 * spec.num_requests
    for request in levels[0]:
        assert len(request.prompt.split()) == request.num_prompt_words
        assert 10 <= request.num_prompt_words <= 30 and 4 <= request.max_tokens <= 9
        assert request.arrival_s == 0.0
    # The same seed gives the same workload; another seed another one.
    assert build_level(spec, 0) == levels[0]
    assert build_level(make_spec(seed=1), 0) != levels[0]


def test_shared_prefix_is_common_and_the_rest_unique():
    spec = make_spec(shared_prefix_words=8)
    prefix = shared_prefix(spec)
    requests = build_level(spec, 0)
    assert len(prefix) == 8
    assert all(r.prompt.split()[:8] == prefix for r in requests)
    assert len({tuple(r.prompt.split()[8:]) for r in requests}) == len(requests)


def test_poisson_arrivals_increase_at_about_the_rate():
    spec = make_spec(num_requests=400, rate=50.0)
    arrivals = [r.arrival_s for r in build_level(spec, 0)]
    assert arrivals[0] == 0.0
    assert all(a < b for a, b in zip(arrivals, arrivals[1:], strict=False))
    mean_gap_s = arrivals[-1] / (len(arrivals) - 1)
    assert 0.8 / 50 < mean_gap_s < 1.2 / 50


def test_too_short_prompts_cannot_all_be_unique():
    with pytest.raises(WorkloadError, match="too few"):
        build_level(make_spec(prompt_words=IntRange(1, 1), num_requests=500), 0)
