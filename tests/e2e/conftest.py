"""One shared SmolLM2 server for the end-to-end tests (loading once keeps CI short)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_process import ServeProcess

LANES = 8


def stage_config(*, lanes: int = LANES, queue_capacity: int = 64, ctx_size: int = 4096,
                 extra: str = "") -> str:
    return f"""
[stage]
id = "e2e"

[runtime]
ctx_size = {ctx_size}
lane_count = {lanes}
threads = 2
threads_batch = 2
queue_capacity = {queue_capacity}

[http]
listen = "127.0.0.1:0"
{extra}
"""


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    proc = ServeProcess(stage_config(), tmp_path_factory.mktemp("serve"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
