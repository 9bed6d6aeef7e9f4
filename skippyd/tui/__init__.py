"""``skippyd top`` and ``skippyd status``: views of a daemon's control socket.

:func:`run_top` is the entry point the CLI calls for ``skippyd top``; the Textual app
lives in :mod:`skippyd.tui.app` and its socket feed in :mod:`skippyd.tui.source`.
``skippyd status`` and ``skippyd top --once`` are one printer, :mod:`skippyd.tui.status`.
Textual is imported only when the dashboard actually runs. It sees a daemon only through
the control socket and never imports llama_cpp.
"""

from __future__ import annotations

import logging
from pathlib import Path

from skippyd.exitcodes import ExitCode

logger = logging.getLogger(__name__)


def run_top(socket: Path | None, config: Path | None, once: bool, as_json: bool) -> ExitCode:
    """Run ``skippyd top``: the dashboard, or with ``once`` a single snapshot.

    The socket is found by :func:`skippyd.control.client.resolve_socket_path`; the
    dashboard waits for a daemon that is not there yet.

    Args:
        socket: ``--socket``, if given.
        config: ``--config``, if given.
        once: Print one snapshot and exit instead of running the dashboard, exactly as
            ``skippyd status`` does.
        as_json: Print the raw snapshot as JSON (implies ``once``).

    Returns:
        The process exit code (:class:`~skippyd.exitcodes.ExitCode`).
    """
    if once or as_json:
        from skippyd.tui.status import run_status

        return run_status(socket, config, as_json)
    from rich.console import Console
    from rich.markup import escape

    from skippyd.config import ConfigError
    from skippyd.control.client import ControlError, resolve_socket_path

    try:
        path = resolve_socket_path(socket, config, wait=True)
    except ConfigError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]error:[/] invalid config {escape(exc.source or '')}\n{escape(str(exc))}",
            highlight=False)
        return ExitCode.CONFIG
    except ControlError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}",
                                                   highlight=False)
        return ExitCode.UNREACHABLE
    from skippyd.tui.app import TopApp

    logger.debug("watching control socket %s", path)
    TopApp(path).run()
    return ExitCode.OK
