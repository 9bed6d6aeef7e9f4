"""A step-time budget for prompt work: chunked prefill that keeps decoding streams moving.

With live decoders a step carries every decode row plus only the prompt tokens that fit
in a target step time, so running streams get a token every step while a long prompt is
prefilled over several; without decoders nothing waits and prompts take the whole token
budget. The target is at least a few steps of the decode rows alone
(:meth:`StepCostModel.step_target_us`), so a model whose rows are slow still gets prompt
chunks that run at full speed. :class:`TargetStretch` lengthens the target while long
prompts queue up (or short ones come in a burst); :class:`StepCostModel` learns a step's
cost from the plans that ran. Pure: no clock, no threads; the driver feeds it durations.

The reasoning and the measurements behind the constants: ``docs/scheduler.md``,
*Planning an iteration* ("The step-time budget", "When long prompts queue up").
"""

from __future__ import annotations

import logging
import math

from skippyd.engine.policy.plan import IterationPlan

logger = logging.getLogger(__name__)

#: Share of its weight a past observation keeps at each new one: the fit forgets a step
#: after some tens of steps.
COST_MEMORY = 0.95
#: Prompt tokens per iteration before any cost was observed: small enough that a first
#: chunk on a slow machine stays near a typical target, large enough to make progress.
INITIAL_PREFILL_TOKENS = 32
#: Prompt tokens an iteration with live decoders always carries, whatever the estimate,
#: so a prompt always progresses (a budget below one token would starve it).
MIN_PREFILL_TOKENS = 16
#: Prompt tokens of a chunk beside decoders that llama.cpp prefills at full speed: its CPU
#: flash attention runs a micro-batch of 64 or more query rows through a tiled kernel, a
#: smaller one row by row. With one KV stream per lane a chunk's first token goes in the
#: decoders' micro-batch, so the chunk's own holds 64 of these 65.
EFFICIENT_PREFILL_TOKENS = 65
#: How many times its target a step may take to carry an efficient chunk (see above):
#: while a prompt waits, the faster kernel's prompt speed is worth a step this long.
EFFICIENT_CHUNK_STRETCH = 2
#: How far past its prompt budget a step may go when that saves a long prompt a whole
#: chunk (see ``planning.even_chunk``): every chunk pays a pass over the weights, so a
#: few more tokens in each of the prompt's steps cost less than one more chunk.
CHUNK_OVERRUN = 1.125
#: Most times its target a step may take while prompts queue up (see :class:`TargetStretch`).
MAX_TARGET_STRETCH = 4
#: Short prompts pending at once that make a burst: the step stretches by their count.
BURST_PROMPTS = 3


class TargetStretch:
    """How many times its target a step may take, from the prompts pending.

    One target per pending long prompt (one that needs more than one step at the target),
    or per short prompt in a burst, at most :data:`MAX_TARGET_STRETCH`; from the moment
    two long prompts are pending until none is, at least two, so a steady stream of long
    prompts is served near full speed instead of queueing without end.
    """

    def __init__(self) -> None:
        self._queued = False
        self.current = 1
        """The factor of the last step planned."""

    def factor(self, long_prompts: int, short_prompts: int = 0) -> int:
        """The stretch for a step planned with ``long_prompts`` prompts pending that need
        more than one step at the target and ``short_prompts`` that fit in one;
        remembers whether long prompts have queued up (a burst of short ones stretches
        only while it lasts)."""
        if long_prompts <= 0:
            self._queued = False
        elif long_prompts > 1:
            self._queued = True
        floor = 2 if self._queued else 1
        burst = short_prompts if short_prompts >= BURST_PROMPTS else 0
        self.current = max(floor, min(max(long_prompts, burst), MAX_TARGET_STRETCH))
        return self.current


class StepCostModel:
    """Step duration as ``fixed + per_token * tokens`` (µs), learned from executed plans.

    A line fits because one llama.cpp call costs a fixed graph set-up and pass over the
    weights plus compute that grows with its tokens; least squares with exponential
    forgetting (:data:`COST_MEMORY`) follows the machine as load and context lengths change.
    """

    def __init__(self) -> None:
        self._weight = 0.0
        self._sum_x = 0.0
        self._sum_y = 0.0
        self._sum_xx = 0.0
        self._sum_xy = 0.0

    def observe(self, plan: IterationPlan, elapsed_s: float) -> None:
        """Learn from how long ``plan`` took; non-finite or non-positive times are ignored."""
        if isinstance(elapsed_s, bool) or not isinstance(elapsed_s, int | float):
            return
        elapsed_us = float(elapsed_s) * 1e6
        tokens = plan.token_count
        if not math.isfinite(elapsed_us) or elapsed_us <= 0 or tokens <= 0:
            return
        keep = COST_MEMORY
        self._weight = keep * self._weight + 1.0
        self._sum_x = keep * self._sum_x + tokens
        self._sum_y = keep * self._sum_y + elapsed_us
        self._sum_xx = keep * self._sum_xx + tokens * tokens
        self._sum_xy = keep * self._sum_xy + tokens * elapsed_us

    def coefficients(self) -> tuple[float, float] | None:
        """``(fixed_us, per_token_us)`` of the fitted line, or None before any sample.

        With every sample at (nearly) one token count the slope cannot be told from the
        intercept: the whole duration is then charged per token, which overestimates the
        per-token cost and so errs towards smaller chunks.
        """
        if self._weight <= 0:
            return None
        mean_x = self._sum_x / self._weight
        mean_y = self._sum_y / self._weight
        variance = self._sum_xx / self._weight - mean_x * mean_x
        if variance > 1e-6 * mean_x * mean_x and variance > 0.25:
            slope = (self._sum_xy / self._weight - mean_x * mean_y) / variance
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, mean_y / mean_x

    def estimate_us(self, tokens: int) -> float | None:
        """Estimated duration of an iteration of ``tokens`` tokens, once learned."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        fixed, per_token = coefficients
        return fixed + per_token * tokens

    def step_target_us(self, decode_rows: int, target_step_us: int,
                       decode_steps: float) -> int:
        """The step time to plan for: ``target_step_us``, or ``decode_steps`` times the
        estimated step of ``decode_rows`` decode rows alone when that is longer (on a
        model whose decode rows take most of a fixed target, that target leaves room for
        prompt chunks too small to run at full speed); ``target_step_us`` until a cost
        was learned."""
        estimate = self.estimate_us(decode_rows) if decode_rows > 0 else None
        if estimate is None or decode_steps <= 0:
            return target_step_us
        return max(target_step_us, int(decode_steps * estimate))

    def prefill_budget(self, decode_rows: int, target_step_us: int, most: int) -> int:
        """Prompt tokens an iteration with ``decode_rows`` decode rows may carry.

        Args:
            decode_rows: Live decoders in the iteration.
            target_step_us: The step time to stay near (µs).
            most: The most prompt tokens the plan can hold anyway.

        Returns:
            ``most`` without decoders; otherwise what fits in the target beside the decode
            rows, rounded up to :data:`EFFICIENT_PREFILL_TOKENS` when such a step is
            estimated within :data:`EFFICIENT_CHUNK_STRETCH` times the target, and at least
            :data:`MIN_PREFILL_TOKENS` (at most ``most`` in every case).
        """
        if decode_rows == 0:
            return most
        coefficients = self.coefficients()
        if coefficients is None:
            return max(1, min(INITIAL_PREFILL_TOKENS, most))
        fixed, per_token = coefficients
        fits = int((target_step_us - fixed - per_token * decode_rows) / max(per_token, 1e-3)
                   + 1e-6)  # a fit that lands on a whole number is not rounded down
        if fits < EFFICIENT_PREFILL_TOKENS:
            efficient_us = fixed + per_token * (decode_rows + EFFICIENT_PREFILL_TOKENS)
            if efficient_us <= EFFICIENT_CHUNK_STRETCH * target_step_us:
                fits = EFFICIENT_PREFILL_TOKENS
        return max(1, min(max(fits, MIN_PREFILL_TOKENS), most))


