"""Environment switches that change a stage's config, read once, when a config is parsed.

Two variables override the config, so a stage can be switched for a debugging run or an
experiment without editing its file; everything else is set in the TOML file:

* ``SKIPPYD_SAFE_MODE`` (``1``/``true``/``yes``/``on``, any case) turns
  ``runtime.safe_mode`` on: one sequence per decode, a debugging fallback.
* ``SKIPPYD_PIPELINE_DECODE_GROUPS`` sets ``runtime.pipeline_decode_groups``; a value that
  is not a positive integer means 1 (one decode group), never "use the default".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

SAFE_MODE_ENV = "SKIPPYD_SAFE_MODE"
PIPELINE_DECODE_GROUPS_ENV = "SKIPPYD_PIPELINE_DECODE_GROUPS"
_TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
#: Names these switches had before they took skippyd's own prefix: no longer read, but
#: a stage started with one set says so instead of ignoring it in silence.
FORMER_NAMES = {"SKIPPY_ITERATION_SCHEDULER_SAFE_MODE": SAFE_MODE_ENV,
                "SKIPPY_PIPELINE_DECODE_GROUPS": PIPELINE_DECODE_GROUPS_ENV}


def safe_mode_from_value(value: str | None) -> bool:
    """True iff ``value`` is one of 1/true/yes/on, case-insensitively."""
    return (value or "").strip().lower() in _TRUE_VALUES


def pipeline_decode_groups_from_value(value: str | None) -> int:
    """Parse a positive integer group count; anything else means 1 (one decode group)."""
    try:
        groups = int((value or "").strip())
    except ValueError:
        return 1
    return groups if groups > 0 else 1


def apply_environment(data: Mapping[str, Any],
                      environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The TOML document with the environment switches folded into ``[runtime]``.

    Args:
        data: The parsed document; not modified.
        environ: Environment to read; defaults to ``os.environ``.

    Returns:
        A copy of ``data`` (the same tables where nothing changed).
    """
    env = os.environ if environ is None else environ
    for former, current in FORMER_NAMES.items():
        if former in env:
            logger.warning("%s is no longer read: set %s instead", former, current)
    changes: dict[str, Any] = {}
    if safe_mode_from_value(env.get(SAFE_MODE_ENV)):
        changes["safe_mode"] = True
    if env.get(PIPELINE_DECODE_GROUPS_ENV) is not None:
        raw = env[PIPELINE_DECODE_GROUPS_ENV]
        groups = pipeline_decode_groups_from_value(raw)
        if str(groups) != raw.strip():
            logger.warning("%s=%r is not a positive integer: decode groups off",
                           PIPELINE_DECODE_GROUPS_ENV, raw)
        changes["pipeline_decode_groups"] = groups
    if not changes:
        return dict(data)
    runtime = data.get("runtime")
    table = dict(runtime) if isinstance(runtime, Mapping) else {}
    return {**data, "runtime": {**table, **changes}}
