"""Applying what the runtime sampled to the sequences of a plan."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from skippyd.engine.policy.input_errors import PolicyInputError
from skippyd.engine.policy.plan import IterationPlan, IterationPrediction
from skippyd.engine.policy.sequence import ScheduledSequence, SequenceStatus

logger = logging.getLogger(__name__)


def index_predictions(
    plan: IterationPlan, predictions: Iterable[IterationPrediction]
) -> dict[int, IterationPrediction | None]:
    """Map work index to prediction; a duplicated index maps to None (treated as missing)."""
    if not isinstance(plan, IterationPlan):
        raise PolicyInputError(f"complete_iteration needs an IterationPlan, got "
                               f"{type(plan).__name__}")
    records = list(predictions)
    for record in records:
        if not isinstance(record, IterationPrediction):
            raise PolicyInputError(f"predictions must be IterationPrediction, got "
                                   f"{type(record).__name__}")
    predicted: dict[int, IterationPrediction | None] = {}
    for record in records:
        if record.work_index >= len(plan.work):
            continue
        predicted[record.work_index] = None if record.work_index in predicted else record
    return predicted


def apply_prediction(
    sequence: ScheduledSequence, prediction: IterationPrediction | None,
    finished: list[str], failed: list[str],
) -> None:
    """Apply one sampling row's outcome to its sequence.

    Tokens that follow from accepted drafts were computed into the KV with the row (all
    but the last, which is pending like any sampled token), so the prefill cursor moves
    past them.
    """
    if prediction is None:
        sequence.status = SequenceStatus.FAILED
        failed.append(sequence.id)
        logger.warning("no prediction for the sampling row of %s: sequence failed", sequence.id)
        return
    for position, token in enumerate((prediction.token, *prediction.more)):
        if token < 0:
            sequence.status = SequenceStatus.FINISHED  # stop signal; the token is not kept
            finished.append(sequence.id)
            return
        if position:
            sequence.prefill_cursor += 1
        sequence.generated_tokens.append(token)
        if len(sequence.generated_tokens) >= sequence.max_tokens:
            sequence.status = SequenceStatus.FINISHED
            finished.append(sequence.id)
            return
