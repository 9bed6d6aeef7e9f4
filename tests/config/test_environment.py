"""Environment switches are read once, by the config layer."""

from __future__ import annotations

import pytest

from skippyd.config import ConfigError, parse_config
from skippyd.config.environment import (
    PIPELINE_DECODE_GROUPS_ENV,
    SAFE_MODE_ENV,
    pipeline_decode_groups_from_value,
    safe_mode_from_value,
)

LATER_STAGE = {"stage": {"index": 1, "layer_start": 2},
               "upstream": {"stage_id": "a", "stage_index": 0, "endpoint": "127.0.0.1:9000"},
               "link": {"listen": "127.0.0.1:9001", "secret": "s" * 16}}


def test_the_switches_carry_skippyds_own_prefix(caplog):
    # The names README.md documents; the former SKIPPY_* names are no longer read.
    assert (SAFE_MODE_ENV, PIPELINE_DECODE_GROUPS_ENV) == (
        "SKIPPYD_SAFE_MODE", "SKIPPYD_PIPELINE_DECODE_GROUPS")
    old = {"SKIPPY_ITERATION_SCHEDULER_SAFE_MODE": "1", "SKIPPY_PIPELINE_DECODE_GROUPS": "4"}
    with caplog.at_level("WARNING", logger="skippyd.config.environment"):
        config = parse_config(LATER_STAGE, environ=old)
    assert config.runtime.safe_mode is False
    assert config.runtime.pipeline_decode_groups is None
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "SKIPPY_PIPELINE_DECODE_GROUPS is no longer read: set SKIPPYD_PIPELINE" in said
    assert "SKIPPY_ITERATION_SCHEDULER_SAFE_MODE is no longer read: set SKIPPYD_SAFE" in said


@pytest.mark.parametrize(("value", "enabled"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("off", False), ("", False), ("invalid", False),
    (None, False),
])
def test_safe_mode_parser_is_explicit_and_case_insensitive(value, enabled):
    assert safe_mode_from_value(value) is enabled


@pytest.mark.parametrize("value", [None, "", "  ", "0", "-2", "abc", "1.5"])
def test_groups_default_to_one_and_ignore_invalid_values(value):
    assert pipeline_decode_groups_from_value(value) == 1


def test_groups_parse_trimmed_positive_integers():
    assert pipeline_decode_groups_from_value(" 3 ") == 3
    assert pipeline_decode_groups_from_value("2") == 2


def test_safe_mode_switch_turns_the_config_key_on():
    assert parse_config({}, environ={}).runtime.safe_mode is False
    assert parse_config({}, environ={SAFE_MODE_ENV: "yes"}).runtime.safe_mode is True
    # The switch only turns safe mode on; the file may turn it on without it.
    assert parse_config({"runtime": {"safe_mode": True}}, environ={SAFE_MODE_ENV: "0"}
                        ).runtime.safe_mode is True


def test_the_planned_value_applies_when_the_environment_is_unset():
    final = parse_config(LATER_STAGE, environ={})
    assert final.runtime.pipeline_decode_groups is None
    assert final.planned_decode_groups == 2  # the final stage of two
    middle = parse_config({**LATER_STAGE, "stage": {"index": 1, "layer_start": 2, "layer_end": 3},
                           "downstream": {"stage_id": "c", "stage_index": 2,
                                          "endpoint": "127.0.0.1:9002"}}, environ={})
    assert middle.planned_decode_groups == 3  # assumes one stage after it


def test_ungrouped_on_a_whole_model_and_learned_at_the_handshake_on_stage_0():
    assert parse_config({}, environ={}).planned_decode_groups == 1
    stage0 = parse_config({"downstream": {"stage_id": "b", "stage_index": 1,
                                          "endpoint": "127.0.0.1:9001"},
                           "stage": {"layer_end": 2},
                           "link": {"secret": "s" * 16}}, environ={})
    assert stage0.planned_decode_groups is None


def test_the_environment_override_beats_the_planned_value():
    config = parse_config(LATER_STAGE, environ={PIPELINE_DECODE_GROUPS_ENV: "4"})
    assert config.runtime.pipeline_decode_groups == 4
    assert config.planned_decode_groups == 4


@pytest.mark.parametrize("env", ["", "0", "-1", "many"])
def test_an_unusable_environment_override_does_not_fall_back_to_the_plan(env):
    config = parse_config(LATER_STAGE, environ={PIPELINE_DECODE_GROUPS_ENV: env})
    assert config.planned_decode_groups == 1


def test_the_config_key_is_validated():
    with pytest.raises(ConfigError, match="runtime.pipeline_decode_groups"):
        parse_config({"runtime": {"pipeline_decode_groups": 0}}, environ={})
