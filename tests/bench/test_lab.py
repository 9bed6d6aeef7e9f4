"""Scheduler lab: simulation tests ported by name and the lab's API."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from skippyd.bench.lab import (
    LAB_SCENARIOS,
    LabRow,
    UnknownScenarioError,
    lab_rows_to_json,
    lab_table,
    run_lab,
)
from skippyd.bench.lab_scenarios import (
    SCENARIO_BUILDERS,
    family_config,
    family_of,
    family_trace,
    lab_config,
    radix_requests,
    staggered_requests,
)
from skippyd.bench.lab_sim import (
    RuntimeCostModel,
    SimRequest,
    SimulationError,
    family_switches,
    percentile,
    simulate,
)
from skippyd.engine.policy import SchedulerConfig

COST = RuntimeCostModel()


def _run(name: str):
    scenario = SCENARIO_BUILDERS[name]()
    return simulate(scenario.config, scenario.cost, scenario.requests)


def test_scheduler_simulation_is_deterministic():
    for name in ("staggered-prefill-mixed", "radix-cache-aware", "cold-burst-n4"):
        assert _run(name) == _run(name)


@pytest.mark.parametrize(("families", "fcfs_switches", "dfs_switches"), [
    ([*range(8), *range(8)], 15, 7),
    ([0, 0, 0, 1, 1, 1], 1, 1),
])
def test_named_scheduler_profiles_replay_the_measured_locality_boundary(
    families, fcfs_switches, dfs_switches
):
    requests = family_trace(families)
    owner = family_of(requests)
    fcfs = simulate(family_config(grouping=False), COST, requests)
    dfs = simulate(family_config(grouping=True), COST, requests)
    assert family_switches(fcfs, owner) == fcfs_switches
    assert family_switches(dfs, owner) == dfs_switches


def test_prefix_restore_reduces_modeled_ttft():
    cold, warm = _run("cold-burst-n1"), _run("warm-divergent-n1")
    assert warm.request("request-0").ttft_us < cold.request("request-0").ttft_us
    assert warm.makespan_us < cold.makespan_us


def _decoder_gap(config: SchedulerConfig, requests=None) -> tuple[int, object]:
    report = simulate(config, COST, requests or staggered_requests())
    return report.request("decoder").max_inter_token_us, report


def test_staggered_prefill_exposes_decode_head_of_line_blocking():
    solo_gap, _ = _decoder_gap(lab_config(), staggered_requests()[:1])
    gap, report = _decoder_gap(lab_config())
    assert solo_gap > 0
    assert report.mixed_iterations == 0
    assert gap > 4 * solo_gap


def test_bounded_prefill_iterations_reduce_decode_head_of_line_blocking():
    unbounded_gap, _ = _decoder_gap(lab_config())
    bounded_gap, report = _decoder_gap(lab_config(max_consecutive_prefill_iterations=1))
    assert 4 * bounded_gap < unbounded_gap
    assert report.mixed_iterations == 0


def test_mixed_iterations_fill_prefill_capacity_without_starving_decode():
    bounded_gap, bounded = _decoder_gap(lab_config(max_consecutive_prefill_iterations=1))
    mixed_gap, mixed = _decoder_gap(lab_config(max_consecutive_prefill_iterations=1,
                                                    mixed_prefill_decode=True))
    assert mixed.mixed_iterations > 0
    assert mixed.mean_token_occupancy > bounded.mean_token_occupancy
    assert mixed_gap < bounded_gap
    assert mixed.makespan_us < bounded.makespan_us


def test_concurrent_burst_uses_batches_and_completes_every_request():
    requests = [SimRequest(f"burst-{i}", 0, 128, 8, token_offset=1000 * i) for i in range(4)]
    report = simulate(lab_config(), COST, requests)
    assert report.mean_batch_size > 1
    assert sum(metrics.generated_tokens for metrics in report.requests) == 32
    assert [metrics.id for metrics in report.requests] == [r.id for r in requests]
    assert all(m.completion_us >= m.first_token_us > m.arrival_us for m in report.requests)


def test_real_radix_affinity_prioritizes_the_high_value_prefix():
    config = lab_config(max_active_sequences=1, max_consecutive_prefill_iterations=1)
    fcfs = simulate(config, COST, radix_requests(False, prompt_tokens=1024, resident_tokens=768))
    aware = simulate(config, COST, radix_requests(True, prompt_tokens=1024, resident_tokens=768))
    assert aware.request("c-hot").ttft_us < fcfs.request("c-hot").ttft_us
    assert aware.request("c-hot").queue_wait_us == 0
    assert fcfs.request("c-hot").queue_wait_us > 0


def test_radix_scenarios_give_the_hot_request_lower_ttft():
    fcfs, aware = _run("radix-fcfs"), _run("radix-cache-aware")
    assert aware.request("c-hot").ttft_us < fcfs.request("c-hot").ttft_us
    # Prefix restore applies in both; only the ordering differs.
    assert fcfs.makespan_us == aware.makespan_us


def test_run_lab_reports_every_column_for_the_requested_scenarios():
    rows = run_lab(["waiting-prefix-fcfs", "waiting-prefix-dfs"], bench_runs=1)
    assert [row.scenario for row in rows] == ["waiting-prefix-fcfs", "waiting-prefix-dfs"]
    assert all(row.bench_us_per_run > 0 and row.requests == 3 for row in rows)
    payload = json.loads(json.dumps(lab_rows_to_json(rows)))
    assert list(payload[0]) == [
        "scenario", "requests", "makespan_ms", "request_s", "p95_queue_ms", "p50_ttft_ms",
        "p95_ttft_ms", "p95_latency_ms", "p95_max_itl_ms", "mean_batch",
        "mean_token_occupancy_pct", "prefill_iterations", "decode_iterations",
        "mixed_iterations", "bench_us_per_run",
    ]
    table = lab_table(rows)
    assert [column.header for column in table.columns] == list(payload[0])
    console = Console(width=400, record=True)
    console.print(table)
    assert "waiting-prefix-dfs" in console.export_text()


def test_lab_row_values_follow_the_report():
    report = _run("radix-cache-aware")
    [row] = run_lab(["radix-cache-aware"], bench_runs=0)
    assert isinstance(row, LabRow)
    assert row.makespan_ms == report.makespan_us / 1000
    assert row.p50_ttft_ms == percentile([m.ttft_us for m in report.requests], 50) / 1000
    assert row.request_s == pytest.approx(3 / (report.makespan_us / 1e6))
    assert row.prefill_iterations + row.decode_iterations + row.mixed_iterations == \
        report.iterations


def test_every_named_scenario_is_available():
    expected = {f"cold-burst-n{n}" for n in (1, 2, 4)} | {
        f"warm-divergent-n{n}" for n in (1, 2, 4)} | {
        "staggered-prefill", "staggered-prefill-bounded", "staggered-prefill-mixed",
        "radix-fcfs", "radix-cache-aware", "waiting-prefix-fcfs", "waiting-prefix-dfs"}
    assert set(LAB_SCENARIOS) == expected


def test_unknown_scenario_and_bad_workloads_raise_typed_errors():
    with pytest.raises(UnknownScenarioError, match="'nope'"):
        run_lab(["cold-burst-n1", "nope"])
    with pytest.raises(SimulationError, match="at least one request"):
        simulate(lab_config(), COST, [])
    with pytest.raises(SimulationError, match="unique"):
        simulate(lab_config(), COST, [SimRequest("x", 0, 4, 1), SimRequest("x", 5, 4, 1)])
    with pytest.raises(SimulationError, match="prefix_tokens"):
        simulate(lab_config(), COST, [SimRequest("x", 0, 4, 1, prefix_tokens=5)])
    with pytest.raises(SimulationError, match="refused"):
        simulate(lab_config(max_waiting_sequences=1), COST,
                 [SimRequest("a", 0, 4, 1), SimRequest("b", 0, 4, 1)])


def test_percentile_uses_the_ceil_index_rule():
    assert percentile([], 95) == 0
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(range(1, 21), 95) == 19
    assert percentile([7], 95) == 7


def test_idle_gaps_jump_to_the_next_arrival():
    report = simulate(lab_config(), COST, [SimRequest("late", 5_000, 4, 1)])
    metrics = report.request("late")
    assert metrics.first_scheduled_us == 5_000
    assert metrics.ttft_us == COST.iteration_us_for(prompt_tokens=4, decode_rows=0)
