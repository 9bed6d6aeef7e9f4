"""Metrics, tables, JSON and the progress bar of the load benchmark.

Throughputs divide a level's totals by its duration (level start to the end of its last
request). Only successful requests count towards tokens and latencies; failed ones are
counted by error kind. Ratios are always ``first target / second target``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from skippyd.bench.chart import sweep_chart
from skippyd.bench.loadgen import LevelRun, ProgressHook, RequestRecord, Target, TargetRun
from skippyd.bench.workload import WorkloadSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Spread:
    """Percentiles of one latency, in milliseconds (None without samples)."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def from_seconds(cls, values_s: Iterable[float]) -> Spread:
        """The spread of ``values_s`` (seconds), in milliseconds."""
        values = np.asarray(list(values_s), dtype=float) * 1000
        if values.size == 0:
            return cls()
        p50, p95, p99 = (float(v) for v in np.percentile(values, [50, 95, 99]))
        return cls(p50, p95, p99, float(values.max()))


@dataclass(frozen=True, slots=True)
class LevelMetrics:
    """The summary of one concurrency level on one target."""

    concurrency: int
    num_requests: int
    num_ok: int
    errors: dict[str, int]
    """Failed requests by kind (``http_429``, ``timeout``, ``connection``, ``protocol``…)."""
    error_examples: dict[str, str]
    """The first failure's detail for each kind."""
    duration_s: float
    output_tokens: int
    requested_output_tokens: int
    """Sum of ``max_tokens`` over the successful requests."""
    prompt_tokens: int
    prompt_tokens_source: Literal["usage", "words"]
    """``usage`` when the server reported every prompt's tokens, else the word counts."""
    cached_prompt_tokens: int | None
    """Prompt tokens served from the server's prefix cache, when it reports them."""
    output_tok_s: float
    prompt_tok_s: float
    requests_s: float
    ttft_ms: Spread
    itl_ms: Spread
    latency_ms: Spread


def level_metrics(level: LevelRun) -> LevelMetrics:
    """Summarise one level's records."""
    ok = [r for r in level.records if r.ok]
    errors = Counter(r.error for r in level.records if r.error is not None)
    examples: dict[str, str] = {}
    for record in level.records:
        if record.error is not None:
            examples.setdefault(record.error, record.error_detail or "")
    reported = [r.num_prompt_tokens for r in ok]
    source: Literal["usage", "words"]
    if ok and all(isinstance(n, int) for n in reported):
        prompt_tokens, source = sum(n for n in reported if n is not None), "usage"
    else:
        prompt_tokens, source = sum(r.num_prompt_words for r in ok), "words"
    output_tokens = sum(r.num_output_tokens for r in ok)
    cached = [r.num_cached_tokens for r in ok if r.num_cached_tokens is not None]
    duration_s = max(level.duration_s, 1e-9)
    return LevelMetrics(
        concurrency=level.concurrency, num_requests=len(level.records), num_ok=len(ok),
        errors=dict(sorted(errors.items())), error_examples=examples, duration_s=level.duration_s,
        output_tokens=output_tokens, requested_output_tokens=sum(r.max_tokens for r in ok),
        prompt_tokens=prompt_tokens, prompt_tokens_source=source,
        cached_prompt_tokens=sum(cached) if cached else None,
        output_tok_s=output_tokens / duration_s, prompt_tok_s=prompt_tokens / duration_s,
        requests_s=len(ok) / duration_s,
        ttft_ms=Spread.from_seconds(r.ttft_s for r in ok if r.ttft_s is not None),
        itl_ms=Spread.from_seconds(gap for r in ok for gap in _gaps(r.chunk_times_s)),
        latency_ms=Spread.from_seconds(r.latency_s for r in ok),
    )


def _gaps(times_s: Sequence[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(times_s, times_s[1:], strict=False)]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is zero."""
    return None if a is None or b is None or b == 0 else a / b


def _num(value: float | None) -> str:
    """Three or four significant digits: enough to compare, narrow enough for a table."""
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1000 \
        else f"{value:.0f}"


def _cached_pct(m: LevelMetrics) -> str:
    if m.cached_prompt_tokens is None or not m.prompt_tokens:
        return "-"
    return f"{100 * m.cached_prompt_tokens / m.prompt_tokens:.0f}"


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in errors.items()) or "0"


def error_lines(run: TargetRun, metrics: Sequence[LevelMetrics]) -> list[str]:
    """One line per (level, error kind) with its count and first detail."""
    return [f"{run.target.name} {m.concurrency} streams: {count} x {kind}: "
            f"{m.error_examples.get(kind, '')}"
            for m in metrics for kind, count in m.errors.items()]


def _table(title: str, columns: Sequence[str], caption: str | None = None) -> Table:
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def target_tables(run: TargetRun, metrics: Sequence[LevelMetrics]) -> list[Table]:
    """Two tables, one row per level: throughput and errors, then latencies."""
    model = run.target.model.rsplit("/", 1)[-1]  # some servers name models by file path
    name = f"{run.target.name} ({model} at {run.target.base_url})"
    throughput = _table(f"{name}: throughput", ("streams", "ok/n", "errors", "out tok/s",
                                                "prompt tok/s", "req/s", "duration s",
                                                "cached prompt %"))
    latency = _table(f"{name}: latency (ms)",
                     ("streams", "TTFT p50", "TTFT p95", "TTFT p99", "ITL p50", "ITL p95",
                      "ITL p99", "ITL max", "e2e p50", "e2e p99"),
                     caption="TTFT: to the first token with text; ITL: between text chunks")
    for m in metrics:
        throughput.add_row(str(m.concurrency), f"{m.num_ok}/{m.num_requests}",
                           _errors_text(m.errors), _num(m.output_tok_s), _num(m.prompt_tok_s),
                           _num(m.requests_s), _num(m.duration_s), _cached_pct(m))
        latency.add_row(str(m.concurrency), _num(m.ttft_ms.p50), _num(m.ttft_ms.p95),
                        _num(m.ttft_ms.p99), _num(m.itl_ms.p50), _num(m.itl_ms.p95),
                        _num(m.itl_ms.p99), _num(m.itl_ms.max), _num(m.latency_ms.p50),
                        _num(m.latency_ms.p99))
    return [throughput, latency]


#: Compared metrics: (JSON key, label, getter, higher is better).
_COMPARED = (
    ("output_tok_s", "out tok/s", lambda m: m.output_tok_s, True),
    ("requests_s", "req/s", lambda m: m.requests_s, True),
    ("ttft_p50_ms", "TTFT p50 ms", lambda m: m.ttft_ms.p50, False),
    ("ttft_p95_ms", "TTFT p95 ms", lambda m: m.ttft_ms.p95, False),
    ("itl_p50_ms", "ITL p50 ms", lambda m: m.itl_ms.p50, False),
    ("latency_p50_ms", "e2e p50 ms", lambda m: m.latency_ms.p50, False),
)


def comparison_rows(first: Sequence[LevelMetrics],
                    second: Sequence[LevelMetrics]) -> list[dict[str, Any]]:
    """Per level, each compared metric for both targets and their ratio first/second."""
    rows = []
    for a, b in zip(first, second, strict=True):
        row: dict[str, Any] = {"concurrency": a.concurrency}
        for key, _, get, _ in _COMPARED:
            row[key] = {"first": get(a), "second": get(b), "ratio": ratio(get(a), get(b))}
        rows.append(row)
    return rows


def comparison_table(first: TargetRun, second: TargetRun, rows: Sequence[dict[str, Any]]) -> Table:
    """Both targets side by side, metric by metric, with the ratio first/second."""
    a, b = first.target.name, second.target.name
    table = _table(f"{a} vs {b}", ("streams", "metric", a, b, "ratio"),
                   caption=f"ratio = {a} / {b}: throughput > 1 and latency < 1 favour {a}")
    for row in rows:
        for position, (key, label, _, higher_better) in enumerate(_COMPARED):
            value = row[key]
            table.add_row(str(row["concurrency"]) if position == 0 else "", label,
                          _num(value["first"]), _num(value["second"]),
                          _ratio_text(value["ratio"], higher_better),
                          end_section=position == len(_COMPARED) - 1)
    return table


def _ratio_text(value: float | None, higher_better: bool) -> str:
    if value is None:
        return "-"
    good = value >= 1 if higher_better else value <= 1
    return f"[{'green' if good else 'red'}]{value:.2f}x[/]"


def report_to_json(spec: WorkloadSpec, runs: Sequence[TargetRun],
                   metrics: Sequence[Sequence[LevelMetrics]], *,
                   per_request: bool = False) -> dict[str, Any]:
    """The whole run for machines: workload, per-target totals and levels, comparison."""
    targets = []
    for run, levels in zip(runs, metrics, strict=True):
        entry: dict[str, Any] = {
            "name": run.target.name, "url": run.target.base_url, "model": run.target.model,
            "usage_option": run.target.send_usage_option,
            "num_requests": sum(m.num_requests for m in levels),
            "num_ok": sum(m.num_ok for m in levels),
            "output_tokens": sum(m.output_tokens for m in levels),
            "prompt_tokens": sum(m.prompt_tokens for m in levels),
            "levels": [dataclasses.asdict(m) for m in levels],
        }
        if per_request:
            entry["requests"] = [_record_json(level.concurrency, record)
                                 for level in run.levels for record in level.records]
        targets.append(entry)
    report: dict[str, Any] = {"workload": spec.to_dict(), "targets": targets}
    if len(metrics) == 2:
        report["comparison"] = comparison_rows(metrics[0], metrics[1])
    return report


def _record_json(concurrency: int, record: RequestRecord) -> dict[str, Any]:
    body = dataclasses.asdict(record)
    body["concurrency"] = concurrency
    return body


def print_report(out: Console, err: Console, spec: WorkloadSpec, runs: Sequence[TargetRun],
                 json_path: Path | None, *, per_request: bool = False,
                 ) -> list[list[LevelMetrics]]:
    """Print each target's tables (errors on ``err``), the comparison of two targets, and
    write the JSON report when asked; returns the metrics per target and level."""
    metrics = [[level_metrics(level) for level in run.levels] for run in runs]
    for run, levels in zip(runs, metrics, strict=True):
        for table in target_tables(run, levels):
            out.print(table)
        for line in error_lines(run, levels):
            err.print(f"[yellow]{escape(line)}[/]", highlight=False)
    if len(runs) == 2:
        out.print(comparison_table(runs[0], runs[1], comparison_rows(*metrics)))
    chart = sweep_chart([run.target.name for run in runs], metrics, out.width)
    if chart is not None:
        out.print(chart)
    if json_path is not None:
        report = report_to_json(spec, runs, metrics, per_request=per_request)
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        err.print(f"wrote {json_path}")
    return metrics


class RichProgress(ProgressHook):
    """A rich progress bar, one task per (target, level).

    Args:
        console: Where to draw (stderr, so tables on stdout stay clean).
    """

    def __init__(self, console: Console) -> None:
        self._progress = Progress("[progress.description]{task.description}", BarColumn(),
                                  MofNCompleteColumn(), "{task.fields[errors]} errors",
                                  TimeElapsedColumn(), console=console)
        self._task: Any = None
        self._num_errors = 0

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def level_started(self, target: Target, concurrency: int, num_requests: int) -> None:
        self._num_errors = 0
        self._task = self._progress.add_task(f"{target.name} {concurrency} streams",
                                             total=num_requests, errors=0)

    def request_done(self, record: RequestRecord) -> None:
        self._num_errors += not record.ok
        self._progress.update(self._task, advance=1, errors=self._num_errors)
