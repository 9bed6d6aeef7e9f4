"""A test-only fault switch: make the worker raise at a named point, once.

``SKIPPYD_FAULT=raise-in=<point>`` makes the worker raise :class:`InjectedFault` the
first time it reaches ``<point>``; ``raise-in=<point>:<n>`` waits until it has accepted
``n`` requests first (generations submitted, or sessions of direct iterations on a later
stage), so a test can have several clients in flight when it fires. The points come in
two kinds, and the worker treats them as it treats a real bug there:

* **fatal** (``plan``, ``execute``, ``complete``, ``command``): the worker cannot tell
  what state it left behind, so it fails everything it holds and stops;
* **request-local** (``prepare``, ``prefix-cache``, ``direct``): only the requests of
  that step fail; the worker goes on.

``SKIPPYD_FAULT=hang-iteration`` (read by :mod:`skippyd.engine.runtime.watch`) makes
every model call hang instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: The environment variable that arms a fault.
FAULT_ENV = "SKIPPYD_FAULT"
#: Points where a fault stops the worker.
FATAL_POINTS = ("plan", "execute", "complete", "command")
#: Points where a fault fails only the requests of that step.
LOCAL_POINTS = ("prepare", "prefix-cache", "direct")
_PREFIX = "raise-in="


class InjectedFault(Exception):
    """Raised by :meth:`FaultSwitch.reach` at the armed point."""


@dataclass(slots=True)
class FaultSwitch:
    """Raises once at ``point`` after ``after`` accepted requests; a None point never
    raises (production)."""

    point: str | None = None
    after: int = 1
    fired: bool = False
    _accepted: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, value: str | None) -> FaultSwitch:
        """The switch ``value`` (``SKIPPYD_FAULT``) arms; values it does not own arm nothing.

        Raises:
            ValueError: A ``raise-in=`` value naming no known point or a bad count.
        """
        if not value or not value.startswith(_PREFIX):
            return cls()
        point, _, count = value[len(_PREFIX):].partition(":")
        if point not in FATAL_POINTS + LOCAL_POINTS:
            raise ValueError(f"{FAULT_ENV}: unknown point {point!r} (one of "
                             f"{', '.join(FATAL_POINTS + LOCAL_POINTS)})")
        try:
            after = int(count) if count else 1
        except ValueError:
            after = 0
        if after < 1:
            raise ValueError(f"{FAULT_ENV}: {value!r}: the count after ':' must be an "
                             "integer >= 1")
        logger.warning("fault injection active: raise in %s after %d request(s)", point, after)
        return cls(point, after)

    def accept(self, key: str) -> None:
        """Count a request (by id or session) towards arming the switch."""
        if self.point is not None and len(self._accepted) < self.after:
            self._accepted.add(key)

    def reach(self, point: str) -> None:
        """Raise :class:`InjectedFault` if this is the armed point and its time has come.

        Raises:
            InjectedFault: The first time only.
        """
        if (point == self.point and not self.fired
                and len(self._accepted) >= self.after):
            self.fired = True
            raise InjectedFault(f"fault injected in {point}")
