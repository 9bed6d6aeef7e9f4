"""The scheduler lab: named workloads through the real policy on a virtual clock.

Times are modelled (see ``RuntimeCostModel``), so the report compares scheduling policies
with one another; ``bench_us_per_run`` is the one real measurement: how long the policy
itself takes to schedule the whole workload.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rich.table import Table

from skippyd.bench.lab_scenarios import SCENARIO_BUILDERS, LabScenario
from skippyd.bench.lab_sim import SimulationReport, percentile, simulate

logger = logging.getLogger(__name__)

#: Scenario names in report order.
LAB_SCENARIOS: tuple[str, ...] = tuple(SCENARIO_BUILDERS)
#: Extra timed runs per scenario.
DEFAULT_BENCH_RUNS = 200


class UnknownScenarioError(ValueError):
    """A requested scenario name is not one of :data:`LAB_SCENARIOS`."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown scheduler lab scenario {name!r}; "
                         f"choose from: {', '.join(LAB_SCENARIOS)}")
        self.name = name


@dataclass(frozen=True, slots=True)
class LabRow:
    """One report line (the lab's report columns)."""

    scenario: str
    requests: int
    makespan_ms: float
    request_s: float
    """Completed requests per second of modelled time."""
    p95_queue_ms: float
    p50_ttft_ms: float
    p95_ttft_ms: float
    p95_latency_ms: float
    p95_max_itl_ms: float
    mean_batch: float
    mean_token_occupancy_pct: float
    prefill_iterations: int
    decode_iterations: int
    mixed_iterations: int
    bench_us_per_run: float
    """Wall-clock time the policy needs to schedule the whole workload once."""


def run_lab(scenarios: list[str] | None = None, *,
            bench_runs: int = DEFAULT_BENCH_RUNS) -> list[LabRow]:
    """Simulate the named scenarios (all when None) and return one row each.

    Each scenario is simulated once for the report, then ``bench_runs`` more times to
    time the scheduler.

    Raises:
        UnknownScenarioError: A name is not in :data:`LAB_SCENARIOS` (nothing is run).
        ValueError: ``bench_runs`` is negative.
    """
    names = list(LAB_SCENARIOS if scenarios is None else scenarios)
    for name in names:
        if name not in SCENARIO_BUILDERS:
            raise UnknownScenarioError(name)
    if bench_runs < 0:
        raise ValueError(f"bench_runs must be >= 0, got {bench_runs}")
    return [_run_scenario(SCENARIO_BUILDERS[name](), bench_runs) for name in names]


def _run_scenario(scenario: LabScenario, bench_runs: int) -> LabRow:
    report = simulate(scenario.config, scenario.cost, scenario.requests)
    bench_us = 0.0
    if bench_runs:
        started = time.perf_counter()
        for _ in range(bench_runs):
            simulate(scenario.config, scenario.cost, scenario.requests)
        bench_us = (time.perf_counter() - started) * 1e6 / bench_runs
    logger.debug("lab scenario %s: %d iterations", scenario.name, report.iterations)
    return lab_row(scenario.name, report, bench_us)


def lab_row(name: str, report: SimulationReport, bench_us_per_run: float = 0.0) -> LabRow:
    """Summarise one simulation report as a lab row."""
    requests = report.requests

    def p_ms(values: Iterable[int], p: float) -> float:
        return percentile(values, p) / 1000

    return LabRow(
        scenario=name,
        requests=len(requests),
        makespan_ms=report.makespan_us / 1000,
        request_s=report.throughput_rps,
        p95_queue_ms=p_ms((r.queue_wait_us for r in requests), 95),
        p50_ttft_ms=p_ms((r.ttft_us for r in requests), 50),
        p95_ttft_ms=p_ms((r.ttft_us for r in requests), 95),
        p95_latency_ms=p_ms((r.latency_us for r in requests), 95),
        p95_max_itl_ms=p_ms((r.max_inter_token_us for r in requests), 95),
        mean_batch=report.mean_batch_size,
        mean_token_occupancy_pct=report.mean_token_occupancy * 100,
        prefill_iterations=report.prefill_iterations,
        decode_iterations=report.decode_iterations,
        mixed_iterations=report.mixed_iterations,
        bench_us_per_run=bench_us_per_run,
    )


def lab_rows_to_json(rows: Iterable[LabRow]) -> list[dict]:
    """Rows as JSON-ready dicts keyed by the report column names."""
    return [dataclasses.asdict(row) for row in rows]


_COLUMN_FORMATS = {
    "requests": "{:d}", "makespan_ms": "{:.3f}", "request_s": "{:.1f}",
    "p95_queue_ms": "{:.3f}", "p50_ttft_ms": "{:.3f}", "p95_ttft_ms": "{:.3f}",
    "p95_latency_ms": "{:.3f}", "p95_max_itl_ms": "{:.3f}", "mean_batch": "{:.2f}",
    "mean_token_occupancy_pct": "{:.1f}", "prefill_iterations": "{:d}",
    "decode_iterations": "{:d}", "mixed_iterations": "{:d}", "bench_us_per_run": "{:.1f}",
}


def lab_table(rows: Iterable[LabRow]) -> Table:
    """A rich table with one column per report field."""
    table = Table(title="scheduler lab (modelled times)")
    table.add_column("scenario", no_wrap=True)
    for column in _COLUMN_FORMATS:
        table.add_column(column, justify="right")
    for row in rows:
        values = [_COLUMN_FORMATS[c].format(getattr(row, c)) for c in _COLUMN_FORMATS]
        table.add_row(row.scenario, *values)
    return table
