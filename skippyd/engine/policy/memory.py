"""Per-component memory accounting of admitted sequences."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from skippyd.engine.policy.config import MemoryComponent
from skippyd.engine.policy.input_errors import checked_count

logger = logging.getLogger(__name__)


class MemoryLedger:
    """Tracks bytes used per memory component by admitted sequences.

    A sequence fits only if it fits in **every** component, so the tightest pool is the
    effective limit.
    """

    def __init__(self, components: Iterable[MemoryComponent]) -> None:
        self._components = tuple(components)
        self._used = [0] * len(self._components)

    def can_reserve(self, admission_tokens: int) -> bool:
        """True if a sequence of ``admission_tokens`` fits in every component."""
        return all(
            used + component.reservation(admission_tokens) <= component.available()
            for used, component in zip(self._used, self._components, strict=True)
        )

    def reserve(self, admission_tokens: int) -> None:
        """Add the reservation of one sequence to every component.

        Precondition: :meth:`can_reserve` returned True for the same size.
        """
        for index, component in enumerate(self._components):
            self._used[index] += component.reservation(admission_tokens)

    def release(self, admission_tokens: int) -> None:
        """Take one sequence's reservation off every component, saturating at 0."""
        for index, component in enumerate(self._components):
            self._used[index] = max(0, self._used[index] -
                                    component.reservation(admission_tokens))

    def overwrite(self, observed: Iterable[int]) -> None:
        """Replace used values with externally observed ones, pairwise.

        Extra or missing entries are ignored. Values are validated
        before any is written.
        """
        values = [checked_count(value, "observed component bytes") for value in observed]
        for index, value in enumerate(values[: len(self._used)]):
            self._used[index] = value

    def over_capacity(self) -> bool:
        """True if any component uses more than it has available."""
        return any(
            used > component.available()
            for used, component in zip(self._used, self._components, strict=True)
        )

    def used(self) -> tuple[tuple[str, int], ...]:
        """``(name, used)`` per component."""
        return tuple(
            (component.name, used)
            for component, used in zip(self._components, self._used, strict=True)
        )

    def available(self) -> tuple[tuple[str, int], ...]:
        """``(name, available)`` per component."""
        return tuple((component.name, component.available())
                     for component in self._components)
