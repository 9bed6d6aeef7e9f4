"""``skippyd top`` and ``skippyd status``: views of a daemon's control socket.

:func:`run_top` is the entry point the CLI calls; the Textual app lives in
:mod:`skippyd.tui.app`, the socket client in :mod:`skippyd.tui.source` and the
``--once`` printer in :mod:`skippyd.tui.once`; ``skippyd status`` is
:mod:`skippyd.tui.status`. Textual is imported only when the dashboard actually runs.
It sees a daemon only through the control socket and never imports llama_cpp.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

#: Exit code for a config that cannot be loaded (as ``skippyd serve``).
EXIT_CONFIG = 2


def run_top(socket: Path | None, config: Path | None, once: bool, as_json: bool) -> int:
    """Run ``skippyd top``: the dashboard, or with ``once`` a single snapshot.

    The socket is ``socket``, else the config's ``control.socket``, else the first
    existing default location (see :func:`skippyd.tui.source.resolve_socket_path`).

    Args:
        socket: ``--socket``, if given.
        config: ``--config``, if given.
        once: Print one snapshot and exit instead of running the dashboard.
        as_json: Print the raw snapshot as JSON (implies ``once``).

    Returns:
        The process exit code: 0, 1 when ``once`` cannot get a snapshot, or
        :data:`EXIT_CONFIG` when the config cannot be loaded (message on stderr).
    """
    from rich.console import Console

    from skippyd.config import ConfigError
    from skippyd.tui.source import resolve_socket_path

    try:
        path = resolve_socket_path(socket, config)
    except ConfigError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] invalid config {exc.source or ''}\n{exc}",
                                   highlight=False)
        return EXIT_CONFIG
    if once or as_json:
        from skippyd.tui.once import run_once

        return run_once(path, as_json)
    from skippyd.tui.app import TopApp

    logger.debug("watching control socket %s", path)
    TopApp(path).run()
    return 0
