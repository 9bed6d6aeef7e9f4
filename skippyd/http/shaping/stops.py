"""Stop-string matching over streamed text.

Generated text arrives in pieces (one per token, already UTF-8 safe from the
detokenizer), and a stop string may straddle several pieces. :class:`StopMatcher`
releases text only once it cannot be part of a stop string: any suffix that is a
prefix of some stop is held back until later text confirms or refutes the match, so a
stop string never reaches the client, not even partly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StopStep:
    """Result of feeding one piece of text to a :class:`StopMatcher`."""

    text: str
    """Text that is safe to send now (may be empty)."""
    stopped: bool
    """A stop string matched; ``text`` ends right before it and nothing follows."""


class StopMatcher:
    """Finds the first occurrence of any stop string in a stream of text pieces.

    Args:
        stops: Stop strings; empty strings are not allowed.

    Raises:
        ValueError: If a stop string is empty.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched; later input is ignored."""
        return self._stopped

    @property
    def held_text(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def push(self, piece: str) -> StopStep:
        """Feed the next piece of generated text.

        Args:
            piece: Text decoded from the next token(s); may be empty.

        Returns:
            The text now safe to emit and whether a stop string matched.
        """
        if self._stopped:
            return StopStep("", True)
        if not self._stops:  # the common case: every piece passes straight through
            return StopStep(piece, False)
        buffer = self._held + piece
        match_at = self._first_match(buffer)
        if match_at is not None:
            self._stopped = True
            self._held = ""
            return StopStep(buffer[:match_at], True)
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopStep(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """Release held text at the end of generation (it turned out not to be a stop).

        Returns:
            The held text, or "" after a stop matched.
        """
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buffer: str) -> int | None:
        positions = [pos for stop in self._stops if (pos := buffer.find(stop)) >= 0]
        return min(positions) if positions else None

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop.

        NOTE: the longest such suffix starts earliest, so holding it covers every stop
        that could still complete; anything before it can be released safely.
        """
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
