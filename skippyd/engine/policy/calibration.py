"""Duration calibration that gates mixed prefill/decode iterations.

Decode-only iterations teach a per-row-count decode baseline (an EWMA in microseconds).
A mixed iteration is only planned once a baseline exists for exactly the current number
of live decoders, and the first mixed step that slows decode beyond a bounded allowance
switches mixing off for the scheduler's lifetime.
"""

from __future__ import annotations

import logging
import math

from skippyd.engine.policy.plan import IterationPlan

logger = logging.getLogger(__name__)

DURATION_EWMA_ALPHA = 0.25
#: Extra time a mixed step may add, as a fraction of the decode baseline ...
MIXED_DECODE_SLOWDOWN_FRACTION = 0.20
#: ... but never less than this (µs): tiny baselines would otherwise forbid any prefill.
MIXED_PREFILL_MIN_EXTRA_US = 8000
#: ... and never more than this (µs): a slow baseline must not excuse a long stall.
MIXED_PREFILL_MAX_EXTRA_US = 20000


class MixedCalibration:
    """Decode baselines by row count and the one-way "mixing is viable" switch."""

    def __init__(self) -> None:
        self.decode_us_ewma_by_rows: dict[int, float] = {}
        """Decode-only iteration duration EWMA (µs), keyed by decode row count."""
        self.mixed_prefill_viable = True
        """Cleared for good by the first mixed step that was too slow."""

    def allows_mixed(self, live_decode_rows: int) -> bool:
        """True if a mixed plan may be built for ``live_decode_rows`` decoders."""
        return (
            self.mixed_prefill_viable
            and live_decode_rows > 0
            and live_decode_rows in self.decode_us_ewma_by_rows
        )

    def observe(self, plan: IterationPlan, elapsed_s: float) -> None:
        """Learn from how long ``plan`` took to execute.

        Non-finite or non-positive durations are ignored.
        """
        if isinstance(elapsed_s, bool) or not isinstance(elapsed_s, int | float):
            return
        elapsed_us = float(elapsed_s) * 1e6
        if not math.isfinite(elapsed_us) or elapsed_us <= 0:
            return
        prefill_tokens, decode_rows = plan.phase_counts()
        if decode_rows == 0:
            return
        if prefill_tokens == 0:
            estimate = self.decode_us_ewma_by_rows.setdefault(decode_rows, elapsed_us)
            estimate += DURATION_EWMA_ALPHA * (elapsed_us - estimate)
            self.decode_us_ewma_by_rows[decode_rows] = estimate
            return
        self._judge_mixed_step(decode_rows, elapsed_us)

    def _judge_mixed_step(self, decode_rows: int, elapsed_us: float) -> None:
        baseline = self.decode_us_ewma_by_rows.get(decode_rows)
        if baseline is None:
            return
        observed_extra = max(elapsed_us - baseline, 1.0)
        allowed_extra = min(
            max(baseline * MIXED_DECODE_SLOWDOWN_FRACTION, MIXED_PREFILL_MIN_EXTRA_US),
            MIXED_PREFILL_MAX_EXTRA_US,
        )
        if observed_extra > allowed_extra and self.mixed_prefill_viable:
            # Permanent by design: a probe that slowed decode once is not retried.
            self.mixed_prefill_viable = False
            logger.info(
                "mixed prefill/decode disabled: %d decode rows took %.0f us extra "
                "(allowed %.0f us over a %.0f us baseline)",
                decode_rows, observed_extra, allowed_extra, baseline,
            )
