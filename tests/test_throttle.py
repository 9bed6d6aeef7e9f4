"""Rate-limited logging: the first event of a kind, then one line per interval."""

from __future__ import annotations

import logging

import pytest

from skippyd.throttle import MAX_KINDS, ThrottledLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_with_a_count_of_the_rest(caplog) -> None:
    clock = Clock()
    log = ThrottledLog(logging.getLogger("test.throttle"), 10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.throttle"):
        assert log.warning("auth", "refused %s", "a")
        assert not any(log.warning("auth", "refused %s", "b") for _ in range(5))
        assert log.info("other", "another kind goes through")
        clock.now = 10.0
        assert log.warning("auth", "refused %s", "c")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["refused a", "another kind goes through",
                        "refused c (5 more like it in the last 10 s not logged)"]
    assert log.total == {"auth": 7, "other": 1}


def test_memory_is_bounded_by_the_number_of_kinds() -> None:
    log = ThrottledLog(logging.getLogger("test.throttle"), 10.0, clock=Clock())
    for i in range(MAX_KINDS * 3):
        log.info(f"kind-{i}", "x")
    assert len(log.total) <= MAX_KINDS + 1


def test_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ThrottledLog(logging.getLogger("x"), -1.0)
