"""Pipeline decode-group helpers of ``direct_batch`` and the worker's group size."""

from __future__ import annotations

import pytest
from fake_runtime import FakeRuntime

from skippyd.engine.worker.direct_batch import direct_coalesce_target, pipeline_group_batch_size


@pytest.mark.parametrize(("lanes", "groups", "expected"),
                         [(4, 1, 4), (4, 2, 2), (5, 2, 3), (1, 4, 1)])
def test_group_batch_size_divides_lanes_rounding_up(lanes, groups, expected):
    assert pipeline_group_batch_size(lanes, groups) == expected


def test_coalescing_stops_at_the_group_size():
    group_size = pipeline_group_batch_size(4, 2)
    assert direct_coalesce_target(4, 1, group_size) == 2


@pytest.mark.parametrize(("lanes", "groups"), [(0, 4), (1, 8), (2, 0), (3, 100)])
def test_grouping_divides_the_lane_count_and_never_reaches_zero(lanes, groups):
    size = pipeline_group_batch_size(lanes, groups)
    assert size >= 1
    assert size <= max(lanes, 1)


def test_worker_uses_the_group_size_for_direct_batches(make_batch_handle):
    worker = make_batch_handle(FakeRuntime(lane_count=4), decode_groups=2)
    settings = worker.settings
    assert settings.max_direct_batch_size == 4
    assert settings.direct_group_batch_size == 2
