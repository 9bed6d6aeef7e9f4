"""bench/vs_llama_server.py: how a round orders its runs and folds them into figures.

The servers themselves are exercised by hand (llama-server is not built on CI); here the
script's own start and measure steps are replaced to record the order they ran in.
"""

from __future__ import annotations

import pytest
from bench_script import loaded


@pytest.fixture(scope="module")
def vs():
    with loaded("vs_llama_server") as module:
        yield module


def test_a_sides_round_figure_is_the_mean_of_its_runs_with_every_error(vs):
    runs = [vs.Measure({"output_tok_s": 100.0, "itl_p50_ms": 40.0}, 0),
            vs.Measure({"output_tok_s": 80.0, "itl_p50_ms": 50.0}, 2, "2 of 32 failed")]
    merged = vs.Measure.mean(runs)
    assert merged.figures == {"output_tok_s": 90.0, "itl_p50_ms": 45.0}
    assert merged.errors == 2 and merged.error_detail == "2 of 32 failed"


def test_every_round_runs_a_b_b_a_in_start_order_with_fresh_prompts(vs, monkeypatch, tmp_path):
    events: list[tuple[str, ...]] = []
    speed = iter([100.0, 90.0, 80.0, 70.0, 60.0, 50.0, 40.0, 30.0])

    def start(setup, server, cache_mode=None, *, defaults=False):
        events.append(("start", server))
        return server

    def measure(setup, proc, workload, server, seed):
        events.append(("run", server, seed))
        return vs.Measure({"output_tok_s": next(speed)}, 0)

    monkeypatch.setattr(vs, "start_server", start)
    monkeypatch.setattr(vs, "measure", measure)
    monkeypatch.setattr(vs, "stop_server", lambda proc, server: events.append(("stop", server)))
    setup = vs.Setup(tmp_path / "m.gguf", 2, 8, 8192, tmp_path / "llama-server", tmp_path)
    result = vs.run_all(setup, ["stream1"], rounds=2)["stream1"]
    sk, ls = "skippyd", "llama-server"
    assert events == [
        ("start", sk), ("start", ls),
        ("run", sk, "stream1:0:0"), ("run", ls, "stream1:0:0"),
        ("run", ls, "stream1:0:1"), ("run", sk, "stream1:0:1"),
        ("stop", sk), ("stop", ls),
        ("start", ls), ("start", sk),
        ("run", ls, "stream1:1:0"), ("run", sk, "stream1:1:0"),
        ("run", sk, "stream1:1:1"), ("run", ls, "stream1:1:1"),
        ("stop", ls), ("stop", sk),
    ]
    # A linear drift of the host (10 tok/s slower every run) moves both sides alike.
    assert [m.figures["output_tok_s"] for m in result.sides[sk]] == [85.0, 45.0]
    assert [m.figures["output_tok_s"] for m in result.sides[ls]] == [85.0, 45.0]
    assert result.ratios(sk, ls, "output_tok_s") == [1.0, 1.0]
