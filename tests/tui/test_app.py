"""The dashboard, driven by Pilot against a scripted control server on a real socket."""

from __future__ import annotations

from pathlib import Path

import pytest
from pilot_helpers import header_text, make_app, queue_shows, rendered, screen_text, wait_for
from scripted_server import ScriptedServer, make_link, make_snapshot
from textual.widgets import Input, Sparkline

from skippyd.tui.app import TopApp
from skippyd.tui.help import HelpScreen
from skippyd.tui.tables import EventLog, LanesTable, LatencyTable
from skippyd.tui.widgets import CacheHits, KvUsage, LinkPanel, WaveFullness

SNAPSHOT = make_snapshot(
    stage={"id": "stage-7", "index": 1, "model": "tiny-model", "layer_start": 2, "layer_end": 4},
    uptime_s=3725.0,
    health={"status": "ok", "reason": None},
    queues={"waiting": 3, "commands": 1, "direct": 0},
    wave={"active_sessions": 5, "batch_size": 8, "fullness": 0.625, "full": False},
    kv={"cells_used": 1024, "cells_total": 4096, "usage": 0.25},
    prefix_cache={"hits": 30, "misses": 10, "hit_rate": 0.75, "matched_tokens": 4500,
                  "bytes_resident": 3 * 2**20, "bytes_host": 0, "evictions": 2},
    throughput={"prompt_tok_s": 123.4, "generation_tok_s": 45.6, "window_s": 10.0},
    latency_ms={"ttft": {"p50": 12.5, "p95": 40.0, "p99": 80.0, "count": 7},
                "itl": {"p50": 8.0, "p95": 9.5, "p99": 11.0, "count": 300},
                "e2e": {"p50": 950.0, "p95": 2500.0, "p99": None, "count": 7}},
    lanes=[{"lane": 0, "request_id": "req-a", "phase": "decode", "prompt_tokens": 34,
            "generated_tokens": 12},
           {"lane": 1, "request_id": "", "phase": "idle", "prompt_tokens": 0,
            "generated_tokens": 0}],
    counters={"finished": 5, "failed": 1, "cancelled": 0, "rejected": 2, "preempted": 0},
)


async def test_panels_show_the_numbers_sent(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    app = make_app(server.path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 3), "first snapshot on screen")
        header = header_text(app)
        for text in ("stage-7", "#1", "tiny-model", "L2-4", "up 1h02m", "ok", "connected"):
            assert text in header
        assert "waiting 3  commands 1\ndirect 0" == rendered(app.query_one("#queue-counts"))
        wave, kv = app.query_one(WaveFullness), app.query_one(KvUsage)
        assert (wave.fraction, wave.detail) == (0.625, "5/8")
        assert "62%" in rendered(wave)
        assert (kv.fraction, kv.detail) == (0.25, "1.0k/4.1k")
        cache = app.query_one(CacheHits)
        assert cache.hit_rate == 0.75
        assert rendered(cache).splitlines() == ["hit 75.0%  30/40", "matched 4.5k tok  ev 2",
                                                "res 3.0 MiB  host 0 B"]
        assert rendered(app.query_one("#prompt-rate")) == "prompt 123.4 tok/s"
        assert rendered(app.query_one("#generation-rate")) == "gen    45.6 tok/s"
        assert app.query_one("#prompt-spark", Sparkline).data[-1] == 123.4
        assert app.query_one("#queue-spark", Sparkline).data[-1] == 3.0
        latency = app.query_one(LatencyTable)
        assert latency.get_row("ttft") == ["ttft", "12.5", "40.0", "80.0", "7"]
        assert latency.get_row("e2e") == ["e2e", "950.0", "2.50s", "-", "7"]
        lanes = app.query_one(LanesTable)
        assert lanes.row_count == 2
        assert [str(cell) for cell in lanes.get_row("0")] == ["0", "decode", "req-a", "34", "12"]
        assert lanes.border_subtitle == "done 5 fail 1 cxl 0 rej 2 pre 0"


async def test_panels_follow_new_snapshots(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 3), "first snapshot")
        server.snapshot = make_snapshot(
            queues={"waiting": 6}, lanes=[{"lane": 3, "request_id": "req-z", "phase": "prefill",
                                           "prompt_tokens": 900, "generated_tokens": 0}])
        await wait_for(pilot, lambda: queue_shows(app, 6), "second snapshot")
        lanes = app.query_one(LanesTable)
        await wait_for(pilot, lambda: lanes.row_count == 1, "lanes table rebuilt")
        assert [str(cell) for cell in lanes.get_row("3")] == ["3", "prefill", "req-z", "900", "0"]
        history = app.query_one("#queue-spark", Sparkline).data
        assert 3.0 in history and history[-1] == 6.0


LATER_LINK = make_link(connections=2, rejected=1, active_sessions=3, bytes_in=5 * 2**20,
                       bytes_out=2048, uptime_s=10.0, busy_s=1.0)
STAGE0_LINK = make_link(
    stage_id="stage-0", stage_index=0, is_final=False, chains=0, connections=0, uptime_s=14.0,
    busy_s=3.0, batches_sent=40, lookahead_steps=1200, lookahead_hits=900,
    lookahead_retracted=3, chain={"up": True, "reason": None, "epoch": 2, "num_stages": 3,
                                  "bytes_out": 3 * 2**20, "bytes_in": 1536},
    links=[{"peer": "stage-1", "role": "downstream", "rtt_avg_ms": 0.4, "rtt_max_ms": 2.1,
            "send_queue_bytes": 0}],
    inflight_batches=3, max_inflight_batches=8)


async def test_link_panel_follows_a_split_stage(server: ScriptedServer) -> None:
    server.snapshot = make_snapshot(queues={"waiting": 1}, link=LATER_LINK)
    app = make_app(server.path)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 1), "a later stage's snapshot")
        panel = app.query_one(LinkPanel)
        assert panel.display and panel.border_title == "link"
        assert rendered(panel).splitlines() == [
            "connections 2 (1 open) · rejected 1 · active sessions 3",
            "received 5.0 MiB · sent 2.0 KiB · busy - (1.00 s)",
            "rtt - · queued 0"]
        server.snapshot = make_snapshot(link={**LATER_LINK, "uptime_s": 12.0, "busy_s": 2.5})
        await wait_for(pilot, lambda: "busy 75.0% (2.50 s)" in rendered(panel),
                       "the busy fraction of two snapshots")
        assert "busy 75.0% (2.50 s)" in screen_text(app)  # not cut at 80 columns
        server.snapshot = make_snapshot(link=STAGE0_LINK)
        await wait_for(pilot, lambda: rendered(panel).startswith("chain"), "stage 0's link")
        assert rendered(panel).splitlines() == [
            "chain up · 3 stages · epoch 2 · busy 25.0% (3.00 s)",
            "sent 3.0 MiB · received 1.5 KiB · look-ahead 900/1.2k hits",
            "rtt stage-1 0.4/2.1 ms · in flight 3/8"]
        assert "in flight 3/8" in screen_text(app)  # the third line fits the panel
        server.snapshot = make_snapshot(queues={"waiting": 5})
        await wait_for(pilot, lambda: queue_shows(app, 5), "a whole-model snapshot")
        assert not panel.display and app.busy_fraction is None


async def test_event_log_and_filter_keys(server: ScriptedServer) -> None:
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await server.wait_subscribers()
        await server.send_event("request.admitted", {"request_id": "a"})
        await server.send_event("worker.start", {"policy": "fcfs"})
        log = app.query_one(EventLog)
        await wait_for(pilot, lambda: len(log.shown) == 3, "two events in the log")
        assert "-- connected to stage-0 (skippyd scripted)" in log.shown[0]
        assert "request.admitted request_id=a" in log.shown[1]
        await pilot.press("slash")
        filter_input = app.query_one("#filter", Input)
        assert filter_input.display and filter_input.has_focus
        await pilot.press("q", "u", "x")  # typed into the filter, not a quit
        await wait_for(pilot, lambda: app.event_filter == "qux", "filter typed")
        assert app.is_running and log.shown == []
        filter_input.value = "worker.s*"  # a glob on the full event name
        await wait_for(pilot, lambda: len(log.shown) == 1, "glob filter applied")
        assert "worker.start policy=fcfs" in log.shown[0]
        await pilot.press("enter")
        await wait_for(pilot, lambda: not filter_input.display, "filter input hidden")
        assert app.event_filter == "worker.s*" and app.query_one(EventLog).has_focus
        await server.send_event("worker.start", {"policy": "lpm"})
        await server.send_event("request.admitted", {"request_id": "b"})
        await wait_for(pilot, lambda: len(log.shown) == 2, "filtered live events")
        assert "policy=lpm" in log.shown[1]
        await pilot.press("escape")
        await wait_for(pilot, lambda: len(log.shown) == 5, "filter cleared")
        assert app.event_filter == "" and log.border_title == "events"


async def test_per_step_events_hide_until_the_steps_key(server: ScriptedServer) -> None:
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await server.wait_subscribers()
        await server.send_event("worker.step", {"decode_tokens": 8}, level="debug")
        await server.send_event("request.finished", {"reason": "stop"})
        log = app.query_one(EventLog)
        await wait_for(pilot, lambda: len(log.shown) == 2, "the lifecycle event")
        assert "request.finished reason=stop" in log.shown[1]
        assert not any("worker.step" in line for line in log.shown)
        await pilot.press("s")
        await wait_for(pilot, lambda: len(log.shown) == 3, "the steps shown")
        assert "worker.step decode_tokens=8" in log.shown[1]
        assert log.border_title == "events + steps"
        await pilot.press("s")
        await wait_for(pilot, lambda: len(log.shown) == 2, "the steps hidden again")


async def test_pause_freezes_the_display_but_keeps_reading(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 3), "first snapshot")
        await pilot.press("p")
        assert app.paused and "PAUSED" in header_text(app)
        log = app.query_one(EventLog)
        shown = list(log.shown)
        server.snapshot = make_snapshot(queues={"waiting": 9})
        await server.send_event("request.finished", {"n": 1})
        await wait_for(pilot, lambda: app.state.snapshot["queues"]["waiting"] == 9,
                       "data read while paused")
        app.repaint()  # a repaint tick while paused changes nothing on screen
        assert queue_shows(app, 3) and list(log.shown) == shown
        await pilot.press("p")
        assert not app.paused and queue_shows(app, 9)
        assert log.shown[:-1] == shown and "request.finished n=1" in log.shown[-1]
        assert "PAUSED" not in header_text(app)


async def test_help_screen_lists_keys(server: ScriptedServer) -> None:
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "help screen")
        text = screen_text(app)
        for label in ("skippyd top: keys", "quit", "pause", "filter events", "this help"):
            assert label in text, label
        await pilot.press("slash")  # the dashboard's keys stay off over the help
        assert isinstance(app.screen, HelpScreen) and not app.query_one("#filter").display
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen), "help closed")
        assert app.is_running


async def test_q_quits(server: ScriptedServer) -> None:
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await server.wait_subscribers()
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running, "exit")
    assert app.return_code == 0


async def test_disconnect_then_reconnect(server: ScriptedServer) -> None:
    server.snapshot = SNAPSHOT
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 3), "first snapshot")
        await server.stop()
        await wait_for(pilot, lambda: "disconnected" in header_text(app), "disconnected shown")
        assert app.has_class("-disconnected")
        assert "retry" in header_text(app)
        server.snapshot = make_snapshot(queues={"waiting": 4})
        await server.start()
        await wait_for(pilot, lambda: queue_shows(app, 4), "data after reconnect")
        await wait_for(pilot, lambda: "connected" in header_text(app)
                       and "disconnected" not in header_text(app), "connected shown")
        assert not app.has_class("-disconnected")
        assert server.num_connections == 2


async def test_no_daemon_shows_disconnected(socket_path: Path) -> None:
    app = make_app(socket_path)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: "disconnected" in header_text(app), "disconnected shown")
        assert app.query_one(LatencyTable).get_row("ttft") == ["ttft", "-", "-", "-", "0"]


async def test_dropped_counts_are_shown(server: ScriptedServer) -> None:
    app = make_app(server.path)
    async with app.run_test() as pilot:
        await server.wait_subscribers()
        await server.send_to_all({"type": "dropped", "count": 17})
        log = app.query_one(EventLog)
        await wait_for(pilot, lambda: log.border_subtitle == "dropped 17", "dropped count")


@pytest.mark.parametrize("size", [(80, 24), (132, 43)])
@pytest.mark.parametrize("link", [None, LATER_LINK], ids=["whole", "split"])
async def test_renders_every_panel_and_resizes(server: ScriptedServer, size, link) -> None:
    server.snapshot = {**SNAPSHOT, "link": link}
    app = make_app(server.path)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: queue_shows(app, 3), "first snapshot")
        await server.send_event("request.admitted", {"request_id": "a"})
        await wait_for(pilot, lambda: "request.admitted" in "".join(
            app.query_one(EventLog).shown), "an event")
        assert_panels_fit(app, size)
        labels = ("queue", "wave", "kv", "prefix cache", "throughput", "latency", "lanes",
                  "events", "stage-7", "waiting 3", "hit 75.0%", "123.4", "12.5", "req-a",
                  "request.admitted", "Quit", "Help")
        if link is not None:
            labels += ("link", "active sessions 3", "received 5.0 MiB")
        # The footer fills in after the first focus change, hence a wait, not an assert.
        await wait_for(pilot, lambda: all(label in screen_text(app) for label in labels),
                       f"labels on screen; missing: {labels}")
        await pilot.resize_terminal(60, 20)
        await pilot.pause()
        await pilot.resize_terminal(*size)
        await pilot.pause()
        assert_panels_fit(app, size)


def assert_panels_fit(app: TopApp, size: tuple[int, int]) -> None:
    """Every panel is visible, inside the screen, and the panels do not overlap.

    The link panel is shown exactly when the snapshot has a ``link`` section.
    """
    width, height = size
    panels = [panel for panel in app.query(".panel") if panel.display]
    link = ["link"] if app.state.snapshot.get("link") else []
    assert [p.id for p in panels] == ["queue", "load", "cache", "throughput", "latency", *link,
                                      "lanes", "events"]
    for panel in panels:
        region = panel.region
        assert region.width >= 10 and region.height >= 3, (panel.id, region)
        assert region.right <= width and region.bottom <= height, (panel.id, region)
    for i, first in enumerate(panels):
        for second in panels[i + 1:]:
            assert not first.region.overlaps(second.region), (first.id, second.id)
