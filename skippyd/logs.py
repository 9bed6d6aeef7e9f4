"""Process-wide logging: one event per line on stderr, in the form the reader expects.

- Under systemd (``JOURNAL_STREAM`` names our stderr) each line starts with its syslog
  priority (``<3>`` for errors … ``<7>`` for debug) and carries no timestamp of its own:
  the journal stamps it, and ``journalctl -p warning`` filters on the priority.
- On a terminal, Rich's handler (colour, aligned columns).
- Elsewhere (a pipe, a file), plain text with a timestamp.
- ``telemetry.log_format = "json"``: one JSON object per line (``ts``, ``level``,
  ``logger``, ``message`` and the record's structured ``fields``), still with the
  priority prefix under systemd.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Any, Literal

LogFormat = Literal["auto", "text", "json"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: syslog priorities (sd-daemon(3)) of the logging levels.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
               (logging.INFO, 6))
_DEBUG_PRIORITY = 7


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level (``ERROR`` -> 3, ``INFO`` -> 6...)."""
    for level, priority in _PRIORITIES:
        if levelno >= level:
            return priority
    return _DEBUG_PRIORITY


def journal_stream(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is connected to the systemd journal.

    systemd sets ``JOURNAL_STREAM=<device>:<inode>`` for a service whose stdout or stderr
    goes to the journal; it holds only while that very file is still our stream (a
    child whose stderr was redirected inherits the variable, not the journal).
    """
    env = os.environ if environ is None else environ
    device, sep, inode = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return f"{info.st_dev}:{info.st_ino}" == f"{device}:{inode}"


class JournalFormatter(logging.Formatter):
    """``<priority>logger: message``; every line of a multi-line record is prefixed."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in self._inner.format(record).splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``extra={"fields": {...}}`` adds structured fields."""

    def __init__(self, *, timestamps: bool = True) -> None:
        super().__init__()
        self._timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {}
        if self._timestamps:
            out["ts"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
                f".{int(record.msecs):03d}Z"
        out.update(level=record.levelname.lower(), logger=record.name,
                   message=record.getMessage())
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def make_handler(fmt: LogFormat = "auto", stream: IO[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> logging.Handler:
    """The stderr handler for ``fmt``, adapted to where ``stream`` goes."""
    stream = sys.stderr if stream is None else stream
    journal = journal_stream(stream, environ)
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter(timestamps=not journal)
        if journal:
            formatter = JournalFormatter(formatter)
    elif journal:
        formatter = JournalFormatter()
    elif fmt == "auto" and stream.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=Console(file=stream), show_path=False,
                                               rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        return handler
    else:
        formatter = logging.Formatter(_FORMAT)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    return handler


def configure_logging(level: str = "info", fmt: LogFormat = "auto",
                      stream: IO[str] | None = None) -> None:
    """Send every log record to stderr at ``level`` (debug, info, warning, error)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level.upper())
    # uvicorn's own error log joins ours; its per-request access log stays off.
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
