"""How long the pure policy takes per iteration, to compare with a real runtime step.

Not a test: a measurement. The result is the scheduling overhead the worker adds on top
of every native batch, for a steady state of decoding sequences.
"""

from __future__ import annotations

import logging
import statistics
import time

from skippyd.engine.policy import (
    LLAMA_MAX_SEQ,
    IterationPlan,
    IterationPrediction,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
)

logger = logging.getLogger(__name__)

#: Prompt length of every measured sequence (short: the prefill is not what is timed).
_PROMPT_TOKENS = 16


def _predict_all(plan: IterationPlan) -> list[IterationPrediction]:
    return [IterationPrediction(index, 1) for index, work in enumerate(plan.work)
            if work.sample_last]


def measure_policy_step(num_sequences: int = 32, samples: int = 200) -> float:
    """Median seconds of one ``plan_iteration`` + ``complete_iteration`` while decoding.

    Builds a scheduler with ``num_sequences`` admitted sequences, runs their prefill, then
    times ``samples`` decode iterations in which every sequence advances one token.

    Args:
        num_sequences: Concurrently decoding sequences (1 .. ``LLAMA_MAX_SEQ``).
        samples: Timed iterations (>= 1).

    Returns:
        The median duration of one step, in seconds.

    Raises:
        ValueError: A count is out of range.
    """
    if not 1 <= num_sequences <= LLAMA_MAX_SEQ:
        raise ValueError(f"num_sequences must be in 1..{LLAMA_MAX_SEQ}, got {num_sequences}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    config = SchedulerConfig(
        max_active_sequences=num_sequences,
        max_waiting_sequences=num_sequences,
        max_tokens_per_iteration=max(num_sequences * _PROMPT_TOKENS, num_sequences),
        prefill_chunk_tokens=256,
        mixed_prefill_decode=False,
        target_step_us=0,
    )
    scheduler = Scheduler(config)
    horizon = samples + 2  # never finish inside the measurement
    for index in range(num_sequences):
        prompt = tuple(range(index * _PROMPT_TOKENS, (index + 1) * _PROMPT_TOKENS))
        scheduler.submit(ScheduledSequence(f"seq-{index:03d}", prompt, horizon))
    prefill = scheduler.plan_iteration()
    scheduler.complete_iteration(prefill, _predict_all(prefill))
    durations = []
    for _ in range(samples):
        started = time.perf_counter()
        plan = scheduler.plan_iteration()
        scheduler.complete_iteration(plan, _predict_all(plan))
        durations.append(time.perf_counter() - started)
        if len(plan.work) != num_sequences:
            raise RuntimeError(f"expected {num_sequences} decode rows, planned {len(plan.work)}")
    return statistics.median(durations)


def main() -> None:
    """Print the policy step (32 decoding sequences) next to a real 8-sequence decode step."""
    from skippyd.bench.runtime import median_decode_step_s
    from skippyd.config import default_model_path

    policy_s = measure_policy_step(32)
    step_s = median_decode_step_s(str(default_model_path()), batch=8)
    print(f"policy plan+complete, 32 sequences: {policy_s * 1e6:8.1f} us (median)")
    print(f"runtime decode step, 8 sequences:   {step_s * 1e6:8.1f} us (median)")
    print(f"policy / step: {policy_s / step_s:.2%}")


if __name__ == "__main__":
    main()
