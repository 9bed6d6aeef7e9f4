"""Pipeline decode-group helpers of ``direct_batch``."""

from __future__ import annotations

import pytest
from fake_runtime import FakeRuntime

from skippyd.engine.worker.direct_batch import (
    PIPELINE_DECODE_GROUPS_ENV,
    direct_coalesce_target,
    pipeline_decode_groups_from_value,
    pipeline_group_batch_size,
    resolve_pipeline_decode_groups,
)


@pytest.mark.parametrize("value", [None, "", "  ", "0", "-2", "abc", "1.5"])
def test_groups_default_to_one_and_ignore_invalid_values(value):
    assert pipeline_decode_groups_from_value(value) == 1


def test_groups_parse_trimmed_positive_integers():
    assert pipeline_decode_groups_from_value(" 3 ") == 3
    assert pipeline_decode_groups_from_value("2") == 2


@pytest.mark.parametrize(("lanes", "groups", "expected"),
                         [(4, 1, 4), (4, 2, 2), (5, 2, 3), (1, 4, 1)])
def test_group_batch_size_divides_lanes_rounding_up(lanes, groups, expected):
    assert pipeline_group_batch_size(lanes, groups) == expected


def test_coalescing_stops_at_the_group_size():
    group_size = pipeline_group_batch_size(4, 2)
    assert direct_coalesce_target(4, 1, group_size) == 2


def test_the_planned_value_applies_when_the_environment_is_unset():
    assert resolve_pipeline_decode_groups(None, 3) == 3


def test_ungrouped_is_the_default_with_neither_source():
    assert resolve_pipeline_decode_groups(None, None) == 1


def test_the_environment_override_beats_the_planned_value():
    assert resolve_pipeline_decode_groups("2", 4) == 2


@pytest.mark.parametrize("env", ["", "0", "-1", "many"])
def test_an_unusable_environment_override_does_not_fall_back_to_the_plan(env):
    assert resolve_pipeline_decode_groups(env, 4) == 1


def test_a_zero_plan_is_treated_as_ungrouped():
    assert resolve_pipeline_decode_groups(None, 0) == 1


@pytest.mark.parametrize(("lanes", "groups"), [(0, 4), (1, 8), (2, 0), (3, 100)])
def test_grouping_divides_the_lane_count_and_never_reaches_zero(lanes, groups):
    size = pipeline_group_batch_size(lanes, groups)
    assert size >= 1
    assert size <= max(lanes, 1)


def test_worker_uses_the_group_size_for_direct_batches(make_handle, monkeypatch):
    monkeypatch.delenv(PIPELINE_DECODE_GROUPS_ENV, raising=False)
    worker = make_handle(FakeRuntime(lane_count=4), pipeline_decode_groups=2)
    settings = worker._shared.worker.settings
    assert settings.max_direct_batch_size == 4
    assert settings.direct_group_batch_size == 2

    monkeypatch.setenv(PIPELINE_DECODE_GROUPS_ENV, "4")
    overridden = make_handle(FakeRuntime(lane_count=4), pipeline_decode_groups=2)
    assert overridden._shared.worker.settings.direct_group_batch_size == 1
