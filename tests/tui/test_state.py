"""Dashboard state and formatting, without an app."""

from __future__ import annotations

import time

import pytest
from scripted_server import make_link, make_snapshot

from skippyd.tui.fmt import (
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_ms,
    link_lines,
    number,
    probe_line,
    section,
)
from skippyd.tui.source import Connected, Disconnected, Dropped, EventReceived, SnapshotReceived
from skippyd.tui.state import DashboardState, EventLine, event_matches, format_event


def test_format_event_shows_the_name_and_its_attributes() -> None:
    ts = time.mktime((2024, 5, 1, 12, 3, 4, 0, 0, -1)) + 0.25
    line = format_event(EventReceived("worker.step", ts, {"batch_size": 4, "ratio": 0.123456},
                                      "debug"))
    assert line.name == "worker.step" and line.detail
    assert line.text == "12:03:04.250 worker.step batch_size=4 ratio=0.1235"
    assert not format_event(EventReceived("request.finished", ts, {})).detail


@pytest.mark.parametrize("pattern, expected", [
    ("", True),
    ("   ", True),
    ("request.*", True),
    ("worker.*", False),
    ("FINISHED", True),
    ("reason=stop", True),
    ("reason=length", False),
    ("request.fin", True),
])
def test_event_matches(pattern: str, expected: bool) -> None:
    line = EventLine("request.finished", "12:00:00.000 request.finished reason=stop")
    assert event_matches(pattern, line) is expected


def test_per_step_events_show_on_request_or_when_a_filter_names_them() -> None:
    line = EventLine("worker.step", "12:00:00.000 worker.step decode_tokens=8", detail=True)
    assert not event_matches("", line)
    assert event_matches("", line, detail=True)
    assert event_matches("worker.*", line) and not event_matches("request.*", line)


def test_state_keeps_bounded_histories() -> None:
    state = DashboardState(history_len=3)
    for waiting in range(5):
        state.apply(SnapshotReceived(make_snapshot(
            queues={"waiting": waiting}, throughput={"prompt_tok_s": waiting * 10.0,
                                                     "generation_tok_s": 1.5})), now=0.0)
    assert list(state.queue_history) == [2.0, 3.0, 4.0]
    assert list(state.prompt_history) == [20.0, 30.0, 40.0]
    assert list(state.generation_history) == [1.5, 1.5, 1.5]
    assert state.num_snapshots == 5
    assert state.snapshot is not None and state.snapshot["queues"]["waiting"] == 4


def test_state_bounds_pending_events_and_counts_drops() -> None:
    state = DashboardState(max_pending_events=2)
    for i in range(4):
        state.apply(EventReceived(f"e{i}", 0.0, {}), now=0.0)
    state.apply(Dropped(10), now=0.0)
    assert [e.name for e in state.take_events()] == ["e2", "e3"]
    assert state.take_events() == []
    assert state.num_dropped == 12


def test_state_tracks_connection_and_uptime() -> None:
    state = DashboardState(wall_clock=lambda: time.mktime((2024, 5, 1, 8, 0, 0, 0, 0, -1)))
    assert state.connection == "connecting" and state.uptime_s(5.0) == 0.0
    state.apply(Connected("stage-0", "skippyd 1"), now=0.0)
    state.apply(SnapshotReceived(make_snapshot(uptime_s=100.0)), now=10.0)
    assert state.uptime_s(12.5) == pytest.approx(102.5)
    state.apply(Disconnected("gone", 0.5), now=13.0)
    assert (state.connection, state.reason, state.retry_in_s) == ("disconnected", "gone", 0.5)
    assert state.uptime_s(20.0) == pytest.approx(100.0)  # frozen at the last snapshot
    state.apply(Disconnected("gone", 1.0), now=14.0)  # a retry failing the same way
    state.apply(Disconnected("refused", 2.0), now=15.0)
    assert [e.text for e in state.take_events()] == [
        "08:00:00.000 -- connected to stage-0 (skippyd 1)",
        "08:00:00.000 -- disconnected: gone",
        "08:00:00.000 -- disconnected: refused",
    ]


def test_tolerant_readers_and_formatters() -> None:
    assert section(None, "kv") == {} and section({"kv": 3}, "kv") == {}
    assert number(None) == 0.0 and number(True) == 0.0 and number(3) == 3.0
    assert [fmt_count(v) for v in (950, 12_345, 4_500_000)] == ["950", "12.3k", "4.5M"]
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**20 / 2) == "1.5 MiB"
    assert [fmt_duration(s) for s in (42, 187, 3720, 183_600)] == ["42s", "3m07s", "1h02m",
                                                                   "2d03h"]
    assert [fmt_ms(v) for v in (None, 12.34, 2500.0)] == ["-", "12.3", "2.50s"]


def test_busy_fraction_comes_from_two_link_samples() -> None:
    state = DashboardState()

    def busy_after(link: dict | None) -> float | None:
        state.apply(SnapshotReceived(make_snapshot(link=link)), now=0.0)
        return state.busy_fraction

    assert busy_after(None) is None
    assert busy_after(make_link(uptime_s=10.0, busy_s=1.0)) is None  # one sample
    assert busy_after(make_link(uptime_s=10.0, busy_s=1.0)) is None  # the same one again
    assert busy_after(make_link(uptime_s=12.0, busy_s=2.5)) == pytest.approx(0.75)
    assert busy_after(make_link(uptime_s=12.0, busy_s=2.5)) == pytest.approx(0.75)  # kept
    assert busy_after(make_link(uptime_s=16.0, busy_s=2.5)) == 0.0
    assert busy_after(make_link(uptime_s=1.0, busy_s=0.5)) is None  # the stage restarted
    assert busy_after(make_link(uptime_s=2.0, busy_s=1.5)) == pytest.approx(1.0)
    assert busy_after(None) is None  # a whole-model stage now


def test_link_lines_of_both_stage_kinds() -> None:
    later = make_link(chains=1, connections=3, rejected=2, active_sessions=4,
                      bytes_in=3 * 2**20, bytes_out=512, busy_s=1.25)
    assert link_lines(later, 0.5) == ["connections 3 (1 open) · rejected 2 · active sessions 4",
                                      "received 3.0 MiB · sent 512 B · busy 50.0% (1.25 s)",
                                      "rtt - · queued 0"]
    stage0 = make_link(lookahead_hits=9, lookahead_steps=12, busy_s=0.5, chain={
        "up": False, "reason": "refused", "epoch": 4, "num_stages": 2, "bytes_out": 2048,
        "bytes_in": 100})
    assert link_lines(stage0, None) == ["chain down · 2 stages · epoch 4 · busy - (0.50 s)",
                                        "sent 2.0 KiB · received 100 B · look-ahead 9/12 hits",
                                        "rtt - · queued 0"]


def test_the_probe_line_shows_round_trips_and_queues() -> None:
    slow = {"peer": "stage-1", "role": "downstream", "rtt_avg_ms": 41.5, "rtt_max_ms": 1250.0,
            "send_queue_bytes": 3 * 2**20}
    back = {"peer": "stage-2", "role": "return", "rtt_avg_ms": 0.4, "rtt_max_ms": 0.9,
            "send_queue_bytes": 0}
    stage0 = make_link(links=[slow, back], inflight_batches=8, max_inflight_batches=8)
    assert probe_line(stage0) == ("rtt stage-1 41.5/1.25s ms (unsent 3.0 MiB) · return "
                                  "0.4/0.9 ms · in flight 8/8")
    up = {"peer": "127.0.0.1:5000", "role": "upstream", "rtt_avg_ms": None,
          "rtt_max_ms": None, "send_queue_bytes": 0}
    assert probe_line(make_link(links=[up], queued_batches=31)) == ("rtt upstream -/- ms · "
                                                                    "queued 31")
