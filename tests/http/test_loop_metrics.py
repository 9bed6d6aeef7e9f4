"""The event loop's own histograms and counters expose what prometheus_client's would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from skippyd.http.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.1, 1.0, 2.5, 3600.0)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition without ``_created`` (a wall-clock time of construction)."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


@given(st.lists(st.floats(min_value=0.0, max_value=1e5, allow_nan=False)
                | st.sampled_from(BUCKETS), max_size=40))
def test_histogram_exposes_the_same_series_as_prometheus_client(values):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("x_seconds", "Doc.", BUCKETS)
    ours.register(mine)
    reference = Histogram("x_seconds", "Doc.", registry=theirs, buckets=BUCKETS)
    for value in values:
        mine.observe(value)
        reference.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert mine.count == len(values)


def test_histogram_exposes_its_creation_time():
    registry = CollectorRegistry()
    registry.register(LoopHistogram("y_seconds", "Doc.", BUCKETS))
    assert registry.get_sample_value("y_seconds_created") > 0


def test_counter_exposes_the_same_series_as_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("tokens", "Doc.")
    ours.register(mine)
    reference = Counter("tokens", "Doc.", registry=theirs)
    for amount in (1, 1, 60, 0):
        mine.inc(amount)
        reference.inc(amount)
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("tokens_total") == 62
    assert ours.get_sample_value("tokens_created") > 0


def test_counter_refuses_to_go_down_and_keeps_its_value():
    counter = LoopCounter("tokens", "Doc.")
    counter.inc(3)
    with pytest.raises(ValueError, match="cannot decrease"):
        counter.inc(-1)
    assert counter.value == 3


@pytest.mark.parametrize("buckets", [(), (1.0, 1.0), (2.0, 1.0)])
def test_histogram_refuses_bounds_that_are_not_increasing(buckets):
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("z_seconds", "Doc.", buckets)


def test_a_name_registered_twice_is_refused_like_any_collector():
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LoopHistogram("dup_seconds", "Doc.", BUCKETS))
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("dup_seconds", "Doc.", registry=registry, buckets=BUCKETS)
