"""Fixtures for the dashboard tests: a short socket path and a scripted control server."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from scripted_server import ScriptedServer


@pytest.fixture
def socket_path() -> Iterator[Path]:
    """A socket path short enough for AF_UNIX (pytest's tmp_path can be too long)."""
    directory = Path(tempfile.mkdtemp(prefix="skt-"))
    try:
        yield directory / "control.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def server(socket_path: Path) -> AsyncIterator[ScriptedServer]:
    """A scripted control server listening on ``socket_path``."""
    async with ScriptedServer(socket_path) as scripted:
        yield scripted
