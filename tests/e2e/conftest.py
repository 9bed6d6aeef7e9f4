"""One shared SmolLM2 server for the end-to-end tests (loading once keeps CI short)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_process import ServeProcess, stage_config


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    proc = ServeProcess(stage_config(socket=str(workdir / "control.sock")), workdir)
    proc.socket_path = workdir / "control.sock"
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
