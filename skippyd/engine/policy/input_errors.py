"""Typed errors raised by the scheduling policy.

Every error is raised before any scheduler state changes, so a caller can report it and
carry on with the scheduler exactly as it was.
"""

from __future__ import annotations

import enum
import logging
import operator
from typing import SupportsIndex, cast

logger = logging.getLogger(__name__)


class PolicyInputError(ValueError):
    """A value handed to the policy is malformed (wrong type, negative count, ...)."""


class SchedulerConfigError(PolicyInputError):
    """A scheduler or memory-component setting is invalid.

    Attributes:
        field: Name of the offending setting.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AdmissionErrorKind(enum.Enum):
    """Why ``Scheduler.submit`` refused a sequence."""

    EMPTY_PROMPT = "empty_prompt"
    DUPLICATE_SEQUENCE = "duplicate_sequence"
    QUEUE_FULL = "queue_full"


class AdmissionError(PolicyInputError):
    """Base class of the three submit refusals; ``kind`` says which one it is."""

    kind: AdmissionErrorKind


class EmptyPromptError(AdmissionError):
    """The sequence has no prompt token."""

    kind = AdmissionErrorKind.EMPTY_PROMPT

    def __init__(self) -> None:
        super().__init__("sequence prompt must contain at least one token")


class DuplicateSequenceError(AdmissionError):
    """A sequence with the same id is already waiting or active.

    Attributes:
        sequence_id: The id that is already taken.
    """

    kind = AdmissionErrorKind.DUPLICATE_SEQUENCE

    def __init__(self, sequence_id: str) -> None:
        super().__init__(f"sequence id is already queued or active: {sequence_id}")
        self.sequence_id = sequence_id


class WaitingQueueFullError(AdmissionError):
    """The waiting queue is at capacity.

    Attributes:
        capacity: The configured waiting-queue capacity.
    """

    kind = AdmissionErrorKind.QUEUE_FULL

    def __init__(self, capacity: int) -> None:
        super().__init__(f"scheduler waiting queue is full ({capacity} requests)")
        self.capacity = capacity


def checked_count(value: object, what: str) -> int:
    """Return ``value`` as a non-negative int or raise :class:`PolicyInputError`.

    A count is never negative, so a negative value is rejected with a message naming
    ``what``. ``bool`` is refused even though it is an ``int`` subclass, because ``True``
    as a token count is always a bug.

    Args:
        value: The candidate count.
        what: Name used in the error message.

    Returns:
        The value as a plain ``int``.

    Raises:
        PolicyInputError: If the value is not an integer or is negative.
    """
    if isinstance(value, bool):
        raise PolicyInputError(f"{what} must be an integer, got bool")
    try:
        # accepts numpy integers, refuses floats (a TypeError, answered below)
        number = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise PolicyInputError(
            f"{what} must be an integer, got {type(value).__name__}"
        ) from None
    if number < 0:
        raise PolicyInputError(f"{what} must be >= 0, got {number}")
    return number
