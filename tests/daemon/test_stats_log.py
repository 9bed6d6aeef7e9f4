"""The periodic throughput line: what happened since the last one, quiet when idle."""

from __future__ import annotations

from dataclasses import dataclass, field

from skippyd.daemon.stats_log import ThroughputLog


@dataclass
class Stats:
    num_active: int = 0
    num_waiting: int = 0
    active_runtime_sessions: int = 0


@dataclass
class Metrics:
    """The counters ThroughputLog reads from ServingMetrics."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefix: dict = field(default_factory=lambda: {"queried_tokens": 0, "matched_tokens": 0})
    link: dict | None = None
    worker: Stats = field(default_factory=Stats)
    cells: tuple[int, int] = (0, 1024)

    def prefix_cache(self) -> dict:
        return self.prefix

    def link_status(self) -> dict | None:
        return self.link

    def stats(self) -> Stats:
        return self.worker

    def kv_cells(self) -> tuple[int, int]:
        return self.cells


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stage_zero_line_covers_the_interval_and_idle_is_quiet():
    clock, metrics = Clock(), Metrics()
    log = ThroughputLog(metrics, serves_http=True, clock=clock)
    clock.now += 10
    assert log.tick() is None  # nothing happened, nothing runs
    metrics.num_prompt_tokens, metrics.num_generated_tokens = 1200, 400
    metrics.prefix = {"queried_tokens": 1200, "matched_tokens": 300}
    metrics.worker = Stats(num_active=3, num_waiting=1)
    metrics.cells = (256, 1024)
    clock.now += 10
    assert log.tick() == ("throughput: prompt 120.0 tok/s, generation 40.0 tok/s, running 3,"
                          " waiting 1, KV 25.0% used, prefix cache hit 25.0% of prompt tokens")
    metrics.num_generated_tokens += 50  # the last tokens, then idle
    metrics.worker = Stats()
    clock.now += 10
    assert log.tick() == ("throughput: prompt 0.0 tok/s, generation 5.0 tok/s, running 0,"
                          " waiting 0, KV 25.0% used, prefix cache hit - of prompt tokens")
    clock.now += 10
    assert log.tick() is None


def test_a_later_stage_reports_its_link_and_busy_share():
    clock = Clock()
    metrics = Metrics(link={"batches": 0, "bytes_in": 0, "bytes_out": 0, "busy_s": 0.0})
    log = ThroughputLog(metrics, serves_http=False, clock=clock)
    metrics.link = {"batches": 50, "bytes_in": 10 * 2**20, "bytes_out": 2**20, "busy_s": 4.0}
    metrics.worker = Stats(active_runtime_sessions=2)
    clock.now += 10
    assert log.tick() == ("throughput: 5.0 batches/s, link in 1.00 MiB/s, out 0.10 MiB/s,"
                          " busy 40%, sessions 2")
