"""Mixed-mode duration calibration."""

from __future__ import annotations

import pytest

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork, Scheduler
from skippyd.engine.policy.calibration import MixedCalibration
from skippyd.engine.policy.input_errors import PolicyInputError


def _plan(decode_rows: int, prompt_tokens: int = 0) -> IterationPlan:
    work = [IterationWork(f"d{i}", (1,), (5,), True, IterationPhase.DECODE)
            for i in range(decode_rows)]
    if prompt_tokens:
        work.append(IterationWork("p", tuple(range(prompt_tokens)),
                                  tuple(range(prompt_tokens)), False, IterationPhase.PREFILL))
    return IterationPlan(work, sum(w.token_count for w in work))


def test_decode_only_steps_build_a_per_row_count_ewma():
    calibration = MixedCalibration()
    calibration.observe(_plan(2), 0.010)
    assert calibration.decode_us_ewma_by_rows == {2: pytest.approx(10_000)}
    calibration.observe(_plan(2), 0.020)
    assert calibration.decode_us_ewma_by_rows[2] == pytest.approx(12_500)
    assert calibration.allows_mixed(2) and not calibration.allows_mixed(1)
    assert not calibration.allows_mixed(0)


@pytest.mark.parametrize("elapsed", [0.0, -1.0, float("nan"), float("inf")])
def test_unusable_durations_are_ignored(elapsed):
    calibration = MixedCalibration()
    calibration.observe(_plan(1), elapsed)
    calibration.observe(_plan(0, 8), 0.5)  # prompt-only steps teach nothing
    assert calibration.decode_us_ewma_by_rows == {}
    assert calibration.mixed_prefill_viable


def test_allowed_extra_is_clamped_between_8_and_20_ms():
    slow_baseline = MixedCalibration()
    slow_baseline.observe(_plan(1), 0.200)  # 20 % would be 40 ms: capped at 20 ms
    slow_baseline.observe(_plan(1, 64), 0.2195)
    assert slow_baseline.mixed_prefill_viable
    slow_baseline.observe(_plan(1, 64), 0.2201)
    assert not slow_baseline.mixed_prefill_viable
    slow_baseline.observe(_plan(1), 0.001)  # never re-enabled, whatever decode does later
    assert not slow_baseline.mixed_prefill_viable and not slow_baseline.allows_mixed(1)


def test_mixed_step_without_a_matching_baseline_changes_nothing():
    calibration = MixedCalibration()
    calibration.observe(_plan(1), 0.010)
    calibration.observe(_plan(3, 100), 10.0)
    assert calibration.mixed_prefill_viable


def test_scheduler_rejects_a_config_of_the_wrong_type():
    with pytest.raises(PolicyInputError, match="SchedulerConfig"):
        Scheduler({"max_active_sequences": 4})
