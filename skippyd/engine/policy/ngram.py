"""Drafts from a request's own text: what followed the last time its recent tokens appeared.

Answers that repeat their prompt (a function with one name changed, a quoted passage, a
document turned into JSON) or themselves continue, most of the time, as the same tokens
did before. :class:`NgramIndex` finds the most recent earlier place where the request's
last tokens appeared and proposes the tokens that came after them there. Pure: no model,
no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Lengths of the token runs looked up, longest first: a longer run that matches is a
#: surer guess; the shortest still finds a copy again two tokens after a change.
MATCH_LENGTHS = (8, 4, 2)


class NgramIndex:
    """Where each run of :data:`MATCH_LENGTHS` tokens last ended, over one token list.

    Feed it the request's tokens as they grow (:meth:`extend`); :meth:`propose` looks up
    the last tokens fed.
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in MATCH_LENGTHS]
        """Per match length: run -> the index just after its latest occurrence, not
        counting the run at the very end (that is the one being looked up)."""
        self._pending: list[tuple[int, ...] | None] = [None] * len(MATCH_LENGTHS)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the indexed list."""
        for token in tokens:
            self._tokens.append(int(token))
            end = len(self._tokens)
            for level, length in enumerate(MATCH_LENGTHS):
                # The run that ended one token ago is now followed by something: index it.
                pending = self._pending[level]
                if pending is not None:
                    self._last_end[level][pending] = end - 1
                self._pending[level] = (tuple(self._tokens[end - length:end])
                                        if end >= length else None)

    def propose(self, limit: int) -> tuple[tuple[int, ...], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the
        longest run of last tokens found again, and that run's length (one of
        :data:`MATCH_LENGTHS`: a longer one is a surer guess); ``((), 0)`` when none is."""
        if limit <= 0:
            return (), 0
        tokens = self._tokens
        for level, length in enumerate(MATCH_LENGTHS):
            run = self._pending[level]
            if run is None:
                continue
            start = self._last_end[level].get(run)
            if start is not None:
                return tuple(tokens[start:start + limit]), length
        return (), 0
