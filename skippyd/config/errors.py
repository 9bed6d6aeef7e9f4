"""The error a bad config raises: every problem found, each naming its key."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in a config, found at ``key`` (a dotted key path or a file name)."""

    key: str
    """Where the problem is: ``runtime.lane_count``, ``upstream``, or the file name."""
    message: str
    """What is wrong, with the offending value when it is safe to show."""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(Exception):
    """A config is invalid.

    ``issues`` lists every problem found; ``str()`` shows them one per line as
    ``key: message``. ``source`` names the file (or ``<overrides>``) when known.
    """

    def __init__(self, issues: Iterable[ConfigIssue], source: str | None = None) -> None:
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        super().__init__("\n".join(str(issue) for issue in self.issues))

    @classmethod
    def single(cls, key: str, message: str, source: str | None = None) -> ConfigError:
        """Make an error with exactly one issue."""
        return cls([ConfigIssue(key, message)], source)

    @property
    def keys(self) -> list[str]:
        """The keys of all issues, in the order found."""
        return [issue.key for issue in self.issues]


class IssueCollector:
    """Gathers issues while a config is checked.

    It remembers which keys were bad so that rules over several keys can skip a bad
    one instead of reporting a confusing second error about it.
    """

    def __init__(self) -> None:
        self.items: list[ConfigIssue] = []
        self.bad: set[str] = set()

    def add(self, key: str, message: str) -> None:
        """Record a problem at ``key`` and mark the key bad."""
        self.items.append(ConfigIssue(key, message))
        self.bad.add(key)

    def clean(self, *keys: str) -> bool:
        """Whether none of ``keys`` has been marked bad."""
        return self.bad.isdisjoint(keys)

    def __bool__(self) -> bool:
        return bool(self.items)
