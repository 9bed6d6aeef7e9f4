"""A downstream stage dies mid-stream: the client gets an error fast, /health says the
pipeline is degraded, stage 0 reconnects on its own, and requests succeed again."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from link_support import STAGE_READY, Chain, wait_until

from skippyd.control.client import ControlClient

pytestmark = pytest.mark.model


@pytest.fixture
def chain(tmp_path, slice_dir):
    chain = Chain((0, 15, 30), tmp_path, slice_dir)
    try:
        yield chain.start()
    finally:
        chain.stop()


def test_killed_downstream_fails_fast_and_the_chain_recovers(chain):
    control = ControlClient.connect(chain.workdir / "stage0.sock", timeout_s=60)
    chain_events = control.events(filter=["chain.*"])
    client = chain.client()
    stream = client.completions.create(model="any", prompt="1, 2, 3,", max_tokens=1500,
                                       temperature=0, stream=True)
    received, killed_at = 0, None
    with pytest.raises(openai.APIError, match="downstream pipeline") as lost:
        for _chunk in stream:
            received += 1
            if received == 5:
                chain.stages[1].proc.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None and time.monotonic() - killed_at < 5.0
    assert lost.value.code == "unavailable"

    health = httpx.get(chain.head.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert "stage-1" in health.json()["reason"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="any", prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.code == "degraded"

    chain.stages[1].proc.wait(10)
    chain.launch(1).wait_for_line(STAGE_READY, timeout=60)
    wait_until(lambda: chain.health()["status"] == "ok", 30, "stage 0 to reconnect")
    text = client.completions.create(model="any", prompt="The capital of France is",
                                     max_tokens=4, temperature=0).choices[0].text
    assert "Paris" in text
    assert chain.status(0)["chain"]["epoch"] == 2
    # The operator's event stream told both changes.
    down, up = (next(chain_events)["event"] for _ in range(2))
    control.close()
    assert (down["name"], down["attributes"]["epoch"]) == ("chain.down", 1)
    assert down["attributes"]["reason"]  # why it was lost, in the link's words
    assert (up["name"], up["attributes"]["epoch"], up["attributes"]["num_stages"]) == (
        "chain.up", 2, 2)
