"""The sweep chart: bars scale with the values, one row per level and target."""

from __future__ import annotations

from rich.console import Console

from skippyd.bench.chart import bar, sweep_chart
from skippyd.bench.report import LevelMetrics, Spread


def level(concurrency: int, tok_s: float, ttft_ms: float | None) -> LevelMetrics:
    return LevelMetrics(
        concurrency=concurrency, num_requests=4, num_ok=4, errors={}, error_examples={},
        duration_s=1.0, output_tokens=64, requested_output_tokens=64, prompt_tokens=64,
        prompt_tokens_source="usage", cached_prompt_tokens=0, output_tok_s=tok_s,
        prompt_tok_s=tok_s, requests_s=1.0, ttft_ms=Spread(p50=ttft_ms), itl_ms=Spread(),
        latency_ms=Spread())


def render(renderable, width: int = 120) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_bars_use_eighths_and_never_overflow():
    assert bar(100.0, 100.0, 10) == "█" * 10
    assert bar(50.0, 100.0, 10) == "█" * 5
    assert bar(1.0, 100.0, 10) == "▏"  # 0.1 column: rounds to one eighth
    assert bar(250.0, 100.0, 10) == "█" * 10
    assert bar(0.0, 100.0, 10) == bar(5.0, 0.0, 10) == ""


def test_a_sweep_with_vs_draws_both_targets_at_every_level():
    metrics = [[level(1, 80.0, 50.0), level(4, 120.0, 90.0), level(8, 130.0, 200.0)],
               [level(1, 40.0, 60.0), level(4, 60.0, 180.0), level(8, 65.0, 400.0)]]
    lines = render(sweep_chart(["skippyd", "llama-server"], metrics, 120))
    assert any("output tok/s by concurrent streams" in line for line in lines)
    assert any("TTFT p50 (ms) by concurrent streams" in line for line in lines)
    rows = [line for line in lines if "skippyd" in line or "llama-server" in line]
    assert len(rows) == 6
    # The fastest level fills its chart; half the throughput draws about half the bar.
    best = next(line for line in rows if "130.0" in line)
    half = next(line for line in rows if "65.0" in line)
    best_bar, half_bar = best[:best.index("130.0")], half[:half.index("65.0")]  # left chart
    assert abs(best_bar.count("█") - 2 * half_bar.count("█")) <= 1 and half_bar.count("█") > 0
    assert all(len(line) <= 120 for line in lines)


def test_one_level_on_one_target_draws_no_chart():
    assert sweep_chart(["skippyd"], [[level(1, 80.0, 50.0)]], 120) is None
    assert sweep_chart(["skippyd"], [[level(1, 80.0, 50.0), level(2, 90.0, None)]], 120)
