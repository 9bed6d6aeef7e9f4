"""bench/split_machines.py: its options, the cores each stage gets, the verdicts, and one
tiny run of a 3-stage chain of the suite's model, pinned and through the shaper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import loaded

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "split_machines.py"


@pytest.fixture(scope="module")
def sm():
    with loaded("split_machines") as module:
        yield module


def test_defaults_measure_every_workload_pinned_on_one_core_per_stage(sm) -> None:
    args = sm.parse_args([])
    assert (args.stages, args.cores_per_stage, args.rtt, args.streams) == (2, 1, [0.0],
                                                                          [1, 8, 16])
    assert args.workloads == list(sm.WORKLOADS) and args.mode == "pinned"
    assert args.lanes == 16 and args.ctx >= 2000 + 64  # a request's prefill prompt and output
    args = sm.parse_args(["--rtt", "0,5,20,5", "--streams", "8", "--unpinned", "--only",
                          "streams,greedy"])
    assert args.rtt == [0.0, 5.0, 20.0] and args.streams == [8]
    assert args.mode == "unpinned" and args.workloads == ["streams", "greedy"]


@pytest.mark.parametrize("argv", [["--only", "bogus"], ["--stages", "1"], ["--rtt", "x"],
                                  ["--rtt", "-5"], ["--streams", "0"], ["--cuts", "5,9"],
                                  ["--cores-per-stage", "4096"], ["--requests-scale", "0"],
                                  ["--set", "http.listen=1"], ["--set", "runtime.x"],
                                  ["--set", "runtime.x="]])
def test_bad_options_are_refused(sm, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        sm.parse_args(argv)
    assert exc.value.code == 2


def test_set_adds_runtime_keys_to_every_server_s_config(sm, tmp_path) -> None:
    args = sm.parse_args(["--set", "runtime.target_decode_steps=0", "--set",
                          "runtime.target_step_ms = 400", "--set", "runtime.kv_layout=unified",
                          "--set", "runtime.threads=2", "--set", "runtime.threads=3"])
    runtime = sm._runtime(args, tmp_path)
    assert (runtime["target_decode_steps"], runtime["target_step_ms"]) == (0, 400)
    # A key the script writes itself is replaced; a bare string is quoted; the last wins.
    assert (runtime["kv_layout"], runtime["threads"], runtime["lane_count"]) == ("unified", 3, 16)


def test_each_stage_gets_cores_of_its_own_and_later_stages_share_when_short(sm) -> None:
    assert sm.assign_cores([0, 1], 2, 1) == [(0,), (1,)]
    assert sm.assign_cores([0, 1], 3, 1) == [(0,), (1,), (0,)]  # the third shares a core
    assert sm.assign_cores([0, 1, 2, 3], 2, 2) == [(0, 1), (2, 3)]
    assert sm.assign_cores([4, 6], 2, 2) == [(4, 6), (4, 6)]


def _cell(side, workload, rnd, value, *, rtt=0.0, streams=1, errors=0, key="output_tok_s",
          texts=None):
    cell = {"round": rnd, "side": side, "workload": workload, "rtt_ms": rtt,
            "streams": streams, "figures": {key: value}, "errors": errors,
            "error_detail": "x" if errors else ""}
    if texts is not None:
        cell["texts"] = texts
    return cell


def _results(sm, cells, rss=()):
    results = sm.Results()
    results.cells.extend(cells)
    results.rss.extend(rss)
    return results


def _rows(sm, results, argv):
    return {row["target"]: row for row in sm.verdicts(results, sm.parse_args(argv))}


def test_a_ratio_target_is_the_median_of_the_rounds_ratios(sm) -> None:
    cells = []
    for rnd, (split, whole) in enumerate([(170.0, 100.0), (150.0, 100.0), (90.0, 50.0)]):
        cells += [_cell("split", "streams", rnd, split, streams=8),
                  _cell("unsplit", "streams", rnd, whole, streams=8)]
    row = _rows(sm, _results(sm, cells), ["--streams", "8", "--only", "streams"])[
        "8 streams: tok/s vs unsplit"]
    assert row["rounds"] == pytest.approx([1.7, 1.5, 1.8])
    assert row["value"] == pytest.approx(1.7) and row["met"]
    # One failed request anywhere makes it NOT MET, whatever the ratio.
    cells[1]["errors"] = 1
    row = _rows(sm, _results(sm, cells), ["--streams", "8", "--only", "streams"])[
        "8 streams: tok/s vs unsplit"]
    assert not row["met"] and "1 errors" in row["note"]


def test_a_round_missing_fails_the_target(sm) -> None:
    cells = [_cell("split", "streams", 0, 200.0, streams=16),
             _cell("unsplit", "streams", 0, 100.0, streams=16)]
    rows = _rows(sm, _results(sm, cells), ["--streams", "16", "--only", "streams",
                                           "--rounds", "2"])
    row = rows["16 streams: tok/s vs unsplit"]
    assert row["value"] == 2.0 and not row["met"] and "1 of 2 rounds" in row["note"]


def test_one_stream_target_depends_on_pinning_and_unpinned_drops_the_core_targets(sm) -> None:
    cells = [_cell("split", "streams", 0, 95.0), _cell("unsplit", "streams", 0, 100.0),
             _cell("split", "prefill", 0, 150.0, key="prompt_tok_s"),
             _cell("unsplit", "prefill", 0, 100.0, key="prompt_tok_s")]
    common = ["--rounds", "1", "--streams", "1,8"]
    pinned = _rows(sm, _results(sm, cells), common + ["--only", "streams,prefill"])
    assert pinned["1 stream, pinned: tok/s vs unsplit"]["met"]
    assert pinned["prefill of 2000 words: prompt tok/s vs unsplit"]["met"]
    assert not pinned["8 streams: tok/s vs unsplit"]["met"]  # asked for, never measured
    unpinned = _rows(sm, _results(sm, cells), common + ["--only", "streams,prefill",
                                                        "--unpinned"])
    assert list(unpinned) == ["1 stream, unpinned: tok/s vs unsplit"]
    assert not unpinned["1 stream, unpinned: tok/s vs unsplit"]["met"]  # 0.95 < 0.97


def test_link_cost_allows_the_rings_own_delay_plus_one_ms(sm) -> None:
    def cells(extra_ms):
        return [_cell("split", "streams", 0, 20.0, key="ms_per_token"),
                *(_cell("split", "streams", 0, 20.0 + extra, rtt=rtt, key="ms_per_token")
                  for rtt, extra in extra_ms.items())]

    argv = ["--rounds", "1", "--streams", "1", "--rtt", "0,5,20", "--only", "streams"]
    rows = _rows(sm, _results(sm, cells({5.0: 5.9, 20.0: 21.5})), argv)
    assert rows["link cost at RTT 5 ms: ms/token over 0 ms, 1 stream"]["met"]
    row = rows["link cost at RTT 20 ms: ms/token over 0 ms, 1 stream"]
    assert row["value"] == pytest.approx(21.5) and not row["met"] and row["goal"] == "<= 21 ms"
    # Three links around the ring of 3 stages: 1.5 RTT of delay.
    rows = _rows(sm, _results(sm, cells({5.0: 8.0, 20.0: 30.9})), argv + ["--stages", "3"])
    assert rows["link cost at RTT 5 ms: ms/token over 0 ms, 1 stream"]["goal"] == "<= 8.5 ms"
    assert all(row["met"] for row in rows.values() if row["target"].startswith("link"))


def test_greedy_output_must_equal_the_unsplit_models_in_every_round(sm) -> None:
    argv = ["--rounds", "2", "--stages", "3", "--rtt", "5", "--only", "greedy"]
    same = [_cell("split", "greedy", r, None, rtt=5.0, texts=["a", "b"]) for r in (0, 1)] + [
        _cell("unsplit", "greedy", r, None, rtt=5.0, texts=["a", "b"]) for r in (0, 1)]
    row = _rows(sm, _results(sm, same), argv)["greedy output, 3 stages, RTT 5 ms: equal to unsplit"]
    assert row["met"] and row["note"] == "4 of 4 texts equal"
    same[1]["texts"] = ["a", "c"]  # one text of one round differs
    row = _rows(sm, _results(sm, same), argv)["greedy output, 3 stages, RTT 5 ms: equal to unsplit"]
    assert not row["met"] and row["note"] == "3 of 4 texts equal"


def test_memory_compares_each_stage_with_the_unsplit_process_of_its_round(sm) -> None:
    rss = [{"round": 0, "phase": "direct", "process": "unsplit", "vmrss_kib": 1000,
            "vmhwm_kib": 1100},
           {"round": 0, "phase": "direct", "process": "stage-0", "vmrss_kib": 550,
            "vmhwm_kib": 560},
           {"round": 0, "phase": "shaped", "process": "stage-0", "vmrss_kib": 580,
            "vmhwm_kib": 590},
           {"round": 0, "phase": "direct", "process": "stage-1", "vmrss_kib": 700,
            "vmhwm_kib": 700}]
    rows = _rows(sm, _results(sm, [], rss), ["--rounds", "1", "--only", "memory"])
    stage0, stage1 = rows["memory: stage 0 RSS vs unsplit"], rows["memory: stage 1 RSS vs unsplit"]
    assert stage0["value"] == pytest.approx(0.58) and stage0["met"]  # its larger phase
    assert stage1["value"] == pytest.approx(0.7) and not stage1["met"]


def test_a_failed_phase_fails_every_target(sm) -> None:
    cells = [_cell("split", "streams", 0, 95.0), _cell("unsplit", "streams", 0, 100.0)]
    results = _results(sm, cells)
    results.failures.append("round 1, shaped links: BenchError: the chain did not connect")
    rows = _rows(sm, results, ["--rounds", "1", "--streams", "1", "--only", "streams"])
    assert rows and not any(row["met"] for row in rows.values())


def test_a_tiny_three_stage_run_pins_every_stage_and_matches_the_unsplit_text(
        tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "machines.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_path), "--stages", "3",
         "--rtt", "0,5", "--streams", "1,2", "--rounds", "1", "--output-tokens", "4",
         "--prompt-tokens", "8", "--prefill-tokens", "40", "--requests-scale", "0.2",
         "--ctx", "512", "--json", str(out)],
        capture_output=True, text=True, timeout=280, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode in (0, 1), result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == [], report["failures"]
    cpus = sorted(os.sched_getaffinity(0))
    expected = [[cpus[i % len(cpus)]] for i in range(3)]
    assert report["stage_cores"] == expected
    # Every thread of every stage ran on its stage's core; the unsplit on stage 0's.
    assert report["affinity"] == {
        "stage-0": expected[0], "stage-1": expected[1], "stage-2": expected[2],
        "unsplit": expected[0]}
    assert all(cell["errors"] == 0 for cell in report["cells"])
    kinds = {(c["side"], c["workload"], c["rtt_ms"], c["streams"]) for c in report["cells"]}
    for rtt in (0.0, 5.0):
        for streams in (1, 2):
            assert ("split", "streams", rtt, streams) in kinds
    assert ("unsplit", "prefill", 0.0, 1) in kinds and ("split", "prefill", 0.0, 1) in kinds
    busy = next(c["busy"] for c in report["cells"] if c["side"] == "split"
                and c["workload"] == "streams")
    assert len(busy) == 3 and all(0 <= b <= 1.01 for b in busy)
    rows = {row["target"]: row for row in report["verdicts"]}
    for rtt in (0, 5):
        assert rows[f"greedy output, 3 stages, RTT {rtt} ms: equal to unsplit"]["met"]
    assert {m["process"] for m in report["rss"]} == {"unsplit", "stage-0", "stage-1", "stage-2"}
    assert "targets" in result.stdout
