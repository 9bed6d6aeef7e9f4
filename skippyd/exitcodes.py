"""The exit codes of every ``skippyd`` command, in one table.

Each code means one thing whichever command returns it, so a script or a systemd unit
can tell a bad command line from a bad config, a missing model or a daemon that is not
there. The README's "Exit codes" section shows the same table.
"""

from __future__ import annotations

import enum
import logging

logger = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """Process exit codes of ``skippyd``."""

    OK = 0
    """Done; ``status`` and ``top --once``: the stage answered and is healthy."""
    FAILURE = 1
    """The command ran and the answer is no: ``status`` of a stage that is loading,
    draining or failed, a benchmark in which every request failed, ``config init``
    refusing to overwrite a file."""
    USAGE = 2
    """The command line is wrong: an unknown option, a missing or malformed argument
    (Click's own code for usage errors)."""
    STARTUP = 3
    """``serve`` could not start: the port or control socket is taken, or the model
    failed to load (uvicorn's code for the same)."""
    CONFIG = 4
    """A config file does not load or validate, or several configs do not form one
    pipeline."""
    MODEL = 5
    """A model file cannot be read or sliced."""
    UNREACHABLE = 6
    """No daemon answered on the control socket."""
    WORKER_FAILED = 7
    """``serve`` stopped because its worker failed (a bug it contained): every request
    it held was answered with an error, then the daemon drained and exited so that a
    supervisor restarts it (systemd's ``Restart=on-failure``)."""
