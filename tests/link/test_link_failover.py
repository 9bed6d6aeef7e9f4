"""A downstream stage dies, or stops without closing its connections: the clients get
an error fast, /health says the pipeline is degraded, new requests are refused at once,
stage 0 reconnects on its own, and requests succeed again, with the unsplit model's
greedy output.

A killed stage closes its connections (the kernel does it), so stage 0 notices at once.
A stopped one (SIGSTOP: as a machine that lost power or its network) leaves them open
and silent, so stage 0 notices by the silence (``skippyd.link.liveness``).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from link_support import LANES, STAGE_READY, Chain, tiny_chain, wait_until
from openai import OpenAI
from test_split_serving import SEQUENTIAL, complete

from skippyd.control.client import ControlClient
from skippyd.link.liveness import SILENCE_TIMEOUT_S

pytestmark = pytest.mark.model

#: Streams in flight when a stage goes (twice the chain's lanes: half of them queued).
STREAMS = 8
#: A killed stage: every stream has failed within this of the kill.
FAIL_WITHIN_S = 2.0
#: A stopped stage: every stream has failed within this of the stop.
DETECT_WITHIN_S = 5.0
#: A new request while the pipeline is degraded is answered within this.
REFUSE_WITHIN_S = 1.0
#: The pipeline serves again within this of the stage being ready (or resumed).
RESTORE_WITHIN_S = 5.0


@pytest.fixture
def chain(tmp_path, slice_dir):
    chain = Chain((0, 15, 30), tmp_path, slice_dir)
    try:
        yield chain.start()
    finally:
        chain.stop()


class Streams:
    """``count`` greedy streams, each in a thread of its own, recording how it ended."""

    def __init__(self, client: OpenAI, count: int) -> None:
        self.count = count
        self._cond = threading.Condition()
        self._streaming = 0
        self._ends: list[tuple[float, str]] = []
        for index in range(count):
            threading.Thread(target=self._run, args=(client, index), daemon=True).start()

    def _run(self, client: OpenAI, index: int) -> None:
        outcome = "finished without an error"
        try:
            stream = client.completions.create(
                model="any", prompt=f"{index}, {index + 1}, {index + 2},", max_tokens=1500,
                temperature=0, stream=True)
            for received, _chunk in enumerate(stream, 1):
                if received == 3:
                    with self._cond:
                        self._streaming += 1
                        self._cond.notify_all()
        except openai.APIError as exc:
            outcome = str(exc)
        with self._cond:
            self._ends.append((time.monotonic(), outcome))
            self._cond.notify_all()

    def wait_streaming(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` streams have received tokens."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._streaming >= count, timeout), (
                f"only {self._streaming} of {count} streams got tokens")

    def wait_ended(self, timeout: float = 30.0) -> list[tuple[float, str]]:
        """Until every stream ended; when and how each did."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._ends) == self.count, timeout), (
                f"{self.count - len(self._ends)} streams still running")
            return list(self._ends)


def failed_within(ends: list[tuple[float, str]], since: float, limit_s: float) -> float:
    """Every stream failed naming the lost pipeline, within ``limit_s`` of ``since``;
    returns the slowest one's delay."""
    for _at, outcome in ends:
        assert "downstream pipeline" in outcome, outcome
    slowest = max(at for at, _ in ends) - since
    assert slowest < limit_s, f"the last stream failed {slowest:.2f} s after the fault"
    return slowest


def refused_at_once(chain: Chain) -> float:
    """A new request gets 503 degraded with Retry-After, without waiting; its time."""
    started = time.monotonic()
    reply = httpx.post(chain.head.url + "/completions", timeout=30,
                       json={"model": "any", "prompt": "Hi", "max_tokens": 2})
    took = time.monotonic() - started
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "degraded"
    assert reply.headers["Retry-After"] == "1"
    assert took < REFUSE_WITHIN_S
    return took


def restored_after_restart(chain: Chain, index: int) -> float:
    """Start stage ``index`` again; seconds from its ready line to a serving pipeline."""
    chain.launch(index).wait_for_line(STAGE_READY, timeout=120)
    ready_at = time.monotonic()
    chain.wait_healthy(RESTORE_WITHIN_S)
    return time.monotonic() - ready_at


def assert_greedy_output_is_unsplit(chain: Chain, unsplit_client: OpenAI) -> None:
    client = chain.client()
    for prompt in SEQUENTIAL:
        split, whole = complete(client, prompt), complete(unsplit_client, prompt)
        assert split.choices[0].text == whole.choices[0].text, prompt


def report(what: str, **seconds: float) -> None:
    print(f"\n{what}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))


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


def test_a_stage_killed_under_8_streams_fails_them_within_2_s_and_a_restart_restores_it(
        chain, unsplit_client):
    streams = Streams(chain.client(), STREAMS)
    streams.wait_streaming(LANES)
    chain.stages[1].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    failed_s = failed_within(streams.wait_ended(), killed_at, FAIL_WITHIN_S)
    refused_s = refused_at_once(chain)
    chain.stages[1].proc.wait(10)
    restored_s = restored_after_restart(chain, 1)
    assert_greedy_output_is_unsplit(chain, unsplit_client)
    assert chain.status(0)["chain"]["epoch"] == 2
    report("SIGKILL stage 1", kill_to_last_error=failed_s, new_request_503=refused_s,
           ready_to_restored=restored_s)


def test_a_stopped_stage_is_taken_for_lost_within_5_s_and_its_resumption_restores_it(
        tmp_path, slice_dir, unsplit_client):
    chain = Chain((0, 15, 30), tmp_path, slice_dir, max_chains=1)
    try:
        chain.start()
        stage1 = chain.stages[1]
        streams = Streams(chain.client(), STREAMS)
        streams.wait_streaming(LANES)
        stage1.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        detected_s = failed_within(streams.wait_ended(), stopped_at, DETECT_WITHIN_S)
        chain.head.wait_for_line(r"pipeline lost: stage-1 sent nothing for", timeout=5)
        health = chain.health()
        assert health["status"] == "degraded" and "stage-1" in health["reason"]
        refused_s = refused_at_once(chain)

        stage1.proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        chain.wait_healthy(RESTORE_WITHIN_S)
        restored_s = time.monotonic() - resumed_at
        assert_greedy_output_is_unsplit(chain, unsplit_client)
        # The connection declared lost was dropped on both ends; a fresh one serves,
        # and the resumed stage holds nothing of the old one.
        stage1.wait_for_line(r"chain connection from \S+ closed", timeout=5)
        assert chain.status(0)["chain"]["epoch"] == 2
        assert chain.status(1)["chains"] == 1
        wait_until(lambda: chain.status(1)["active_sessions"] == 0, 10,
                   "the resumed stage to free the old connection's sessions")
        report("SIGSTOP stage 1", stop_to_last_error=detected_s, new_request_503=refused_s,
               resume_to_restored=restored_s)
    finally:
        _resume(chain)
        chain.stop()


def test_a_stopped_final_stage_of_three_is_taken_for_lost_and_a_restart_restores_it(
        tmp_path, slice_dir, unsplit_client):
    chain = Chain((0, 10, 20, 30), tmp_path, slice_dir, max_chains=1)
    try:
        chain.start()
        streams = Streams(chain.client(), STREAMS)
        streams.wait_streaming(LANES)
        chain.stages[2].proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        detected_s = failed_within(streams.wait_ended(), stopped_at, DETECT_WITHIN_S)
        # The middle stage let go of its chain too: nothing is left waiting on stage 2.
        closed = chain.stages[1].wait_for_line(r"chain connection from \S+ closed",
                                               timeout=DETECT_WITHIN_S)
        assert re.search(r"stage-2 sent nothing|upstream stage closed", closed), closed
        refused_s = refused_at_once(chain)

        chain.stages[2].proc.send_signal(signal.SIGKILL)
        chain.stages[2].proc.wait(10)
        restored_s = restored_after_restart(chain, 2)
        assert_greedy_output_is_unsplit(chain, unsplit_client)
        report("SIGSTOP stage 2 of 3", stop_to_last_error=detected_s,
               new_request_503=refused_s, ready_to_restored=restored_s)
    finally:
        _resume(chain)
        chain.stop()


def test_a_stage_busy_in_a_long_model_call_is_not_taken_for_lost(tmp_path, tiny_model_path):
    """The later stage's model call never returns (the test fault): its link threads
    still answer, so stage 0 keeps the chain up well past the silence timeout."""
    hang = dict(os.environ, SKIPPYD_FAULT="hang-iteration")
    with tiny_chain(tiny_model_path, tmp_path, env=(None, hang)) as (head, later):
        wait_until(lambda: _health(head)["status"] == "ok", 30, "the chain to connect")
        answered = threading.Event()
        threading.Thread(target=_generate, args=(head, answered), daemon=True).start()
        wait_until(lambda: _inflight_batches(head) >= 1, 10, "a batch to reach stage 1")
        watched_until = time.monotonic() + SILENCE_TIMEOUT_S + 2.0
        while time.monotonic() < watched_until:
            assert _health(head)["status"] == "ok"
            assert not answered.wait(0.1)
        later.stop(signal.SIGKILL)  # now it is gone: the request fails at once
        assert answered.wait(FAIL_WITHIN_S + 1)


def _resume(chain: Chain) -> None:
    """Let a stopped stage run again, so it can be stopped."""
    for proc in chain.stages:
        if proc is not None and proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGCONT)


def _health(head) -> dict:
    return httpx.get(head.base_url + "/health", timeout=5).json()


def _generate(head, answered: threading.Event) -> None:
    try:
        httpx.post(head.url + "/completions", timeout=60,
                   json={"prompt": "a b c", "max_tokens": 8})
    finally:
        answered.set()


def _inflight_batches(head) -> float:
    metrics = httpx.get(head.base_url + "/metrics", timeout=5).text
    match = re.search(r"^skippyd_link_inflight_batches (\S+)$", metrics, re.MULTILINE)
    return 0.0 if match is None else float(match[1])
