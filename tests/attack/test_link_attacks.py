"""Attacks on a real split pipeline's stage link (the tiny model in two stages).

Peers that drip handshake bytes used to hold every handshake slot of a later stage, so
a restarted stage 0 could not reconnect and stayed ``degraded``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "link"))
from link_support import STAGE_READY, free_port, tiny_stage  # noqa: E402
from serve_process import ServeProcess  # noqa: E402

from skippyd.bench.attacks import Drippers, IdleFlood, process_figures, running  # noqa: E402
from skippyd.link.wire import FrameKind, encode_frame  # noqa: E402

WAIT_S = 60.0
HELLO = encode_frame(FrameKind.HELLO, b"h" * 120)


def _wait_healthy(head: ServeProcess, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(head.base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("stage 0 did not become healthy:\n" + head.log()[-2000:])
        time.sleep(0.1)


def test_stage_0_reconnects_while_peers_drip_handshakes(tmp_path, tiny_model_path):
    ports = [free_port(), free_port()]
    configs = [tiny_stage(tiny_model_path, tmp_path, index=i, layers=layers, n_batch=128,
                          ports=ports) for i, layers in enumerate([(0, 2), (2, 4)])]
    for i in (0, 1):
        (tmp_path / f"s{i}").mkdir()
    later = ServeProcess(configs[1], tmp_path / "s1")
    head = None
    try:
        later.wait_for_line(STAGE_READY, timeout=60)
        before = process_figures(later.proc.pid)
        link = ("127.0.0.1", ports[1])
        # 3-4 s between bytes, as the attack was reported, plus a fast silent flood.
        drippers = Drippers(link, 32, HELLO, every_s=3.5)
        silent = IdleFlood(link, 64)
        with running(drippers, silent):
            for _ in range(2):  # start stage 0, then restart it: it must get in each time
                head = ServeProcess(configs[0], tmp_path / "s0").wait_ready()
                _wait_healthy(head)
                reply = httpx.post(head.base_url + "/v1/completions", timeout=WAIT_S,
                                   json={"prompt": "ab", "max_tokens": 4})
                assert reply.status_code == 200, reply.text
                head.stop()
                head = None
            peak = process_figures(later.proc.pid)
        assert drippers.completed == 0  # no dripped HELLO was ever waited for in full
        assert silent.stats.cut > 0
        assert (peak["rss_kib"] - before["rss_kib"]) / 1024 < 64
        assert later.proc.poll() is None
        assert "rejected" in later.log()
    finally:
        if head is not None:
            head.stop()
        later.stop()
