"""The systemd notify protocol (sd_notify) without libsystemd.

When systemd starts a ``Type=notify`` service it sets ``NOTIFY_SOCKET`` to a Unix
datagram socket (a path, or an abstract name starting with ``@``); the service sends
newline-separated ``KEY=VALUE`` assignments to it. ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``) ask for ``WATCHDOG=1`` pings at least that often.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)


class SystemdNotifier:
    """Sends sd_notify messages; every method is a no-op outside systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self.watchdog_s = _watchdog_interval(env)
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines, e.g. ``notify(READY=1, STATUS="serving")``.

        Returns False (and logs once at debug) if the message could not be sent; a
        supervisor that went away must never take the daemon down.
        """
        if self._sock is None or self._address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            self._sock.sendto(message.encode(), self._address)
        except OSError as exc:
            logger.debug("sd_notify failed: %s", exc)
            return False
        return True

    def ready(self, status: str) -> None:
        self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.notify(STATUS=status)

    def stopping(self, status: str = "draining") -> None:
        self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> None:
        self.notify(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between required pings, or None when the watchdog is off (or not ours)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    return usec / 1_000_000
