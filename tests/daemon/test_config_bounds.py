"""Every value config check accepts is one the daemon can run with.

For each numeric key of ``[http]`` and ``[link]``, its lowest and highest accepted
values go through the same builders ``skippyd serve`` uses; none may raise.
"""

from __future__ import annotations

import dataclasses

import pytest

from skippyd.config import ConfigError, parse_config
from skippyd.config.schema import HttpSection, LinkSection
from skippyd.daemon.lifecycle import connection_limits, http_limits


def _extremes(section: type) -> list[tuple[str, float]]:
    cases = []
    for spec in dataclasses.fields(section):
        for bound in ("lo", "hi"):
            value = spec.metadata.get(bound)
            if value is not None:
                kind = type(spec.default) if spec.default is not dataclasses.MISSING else int
                cases.append((spec.name, kind(value)))
    return cases


@pytest.mark.parametrize(("key", "value"), _extremes(HttpSection))
def test_http_extremes_fail_check_or_build_the_serving_limits(key, value):
    try:
        config = parse_config({"http": {key: value}})
    except ConfigError as exc:  # refused up front, naming the key: that is fine too
        assert f"http.{key}" in str(exc) or "http." in str(exc)
        return
    http_limits(config)
    connection_limits(config)


def test_the_extremes_are_not_all_refused():
    accepted = 0
    for key, value in _extremes(HttpSection):
        try:
            parse_config({"http": {key: value}})
            accepted += 1
        except ConfigError:
            pass
    assert accepted >= len(_extremes(HttpSection)) - 3


@pytest.mark.parametrize(("key", "value"), _extremes(LinkSection))
def test_link_extremes_parse(key, value):
    assert getattr(parse_config({"link": {key: value}}).link, key) == value
