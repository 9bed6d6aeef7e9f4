"""Real ``skippyd serve`` processes on loopback: an unsplit server and split chains.

Every stage is its own process with its own sliced GGUF (sliced once per session into
a shared cache directory). Chains are started once per session and shared; a test that
kills a stage builds its own chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from link_support import Chain, runtime_section
from openai import OpenAI
from serve_process import ServeProcess


@pytest.fixture(scope="session")
def slice_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slices")


@pytest.fixture(scope="session")
def unsplit(tmp_path_factory, slice_dir):
    config = '[stage]\nid = "unsplit"\n' + runtime_section(slice_dir, threads=1)
    workdir = tmp_path_factory.mktemp("unsplit")
    config += f'[http]\nlisten = "127.0.0.1:0"\n[control]\nsocket = "{workdir / "c.sock"}"\n'
    proc = ServeProcess(config, workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def unsplit_client(unsplit) -> OpenAI:
    return OpenAI(base_url=unsplit.url, api_key="unused", max_retries=0, timeout=60)


def _chain_fixture(bounds):
    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory, slice_dir):
        chain = Chain(bounds, tmp_path_factory.mktemp("chain"), slice_dir)
        try:
            yield chain.start()
        finally:
            chain.stop()
    return fixture


chain2 = _chain_fixture((0, 15, 30))
chain3 = _chain_fixture((0, 10, 20, 30))
