"""The load benchmark's sweep as a chart: throughput and TTFT against concurrency.

Two bar charts side by side, one bar per (concurrency level, target), so a sweep reads at
a glance and ``--vs`` puts both endpoints' bars next to each other at every level. Bars
are drawn with Unicode eighth blocks (a resolution of 1/8 of a column), in Rich tables:
no plotting library, and the same text off a terminal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from skippyd.bench.report import LevelMetrics

logger = logging.getLogger(__name__)

_EIGHTHS = " ▏▎▍▌▋▊▉"
#: Colour of each target's bars, in target order.
TARGET_STYLES = ("cyan", "magenta")
Getter = Callable[["LevelMetrics"], float | None]


def bar(value: float, scale: float, width: int) -> str:
    """``value`` as a bar of at most ``width`` columns, ``scale`` filling them all."""
    if scale <= 0 or value <= 0:
        return ""
    eighths = round(min(value / scale, 1.0) * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[rest] if rest else "")


def _value_text(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def level_chart(title: str, names: Sequence[str], metrics: Sequence[Sequence[LevelMetrics]],
                getter: Getter, *, bar_width: int, digits: int = 1) -> Table:
    """One chart: a row per (level, target), levels in the order measured."""
    values = [[getter(level) for level in levels] for levels in metrics]
    scale = max((v for row in values for v in row if v is not None), default=0.0)
    table = Table(title=title, show_header=False, box=None, pad_edge=False, padding=(0, 1))
    table.add_column(justify="right", style="bold")  # concurrency
    table.add_column()  # target
    table.add_column(width=bar_width, no_wrap=True)
    table.add_column(justify="right")
    for index, level in enumerate(metrics[0]):
        for target, (name, row) in enumerate(zip(names, values, strict=True)):
            value = row[index] if index < len(row) else None
            style = TARGET_STYLES[target % len(TARGET_STYLES)]
            table.add_row(str(level.concurrency) if target == 0 else "", Text(name, style),
                          Text(bar(value or 0.0, scale, bar_width), style),
                          _value_text(value, digits))
    return table


def sweep_chart(names: Sequence[str], metrics: Sequence[Sequence[LevelMetrics]],
                width: int) -> RenderableType | None:
    """Throughput and TTFT p50 charts side by side; None when there is nothing to compare
    (one level on one target)."""
    if len(metrics) < 2 and all(len(levels) < 2 for levels in metrics):
        return None
    label_width = max(len(name) for name in names) + 12
    bar_width = max(8, width // 2 - label_width - 4)
    charts = Table.grid(padding=(0, 4))
    charts.add_column()
    charts.add_column()
    charts.add_row(
        level_chart("output tok/s by concurrent streams", names, metrics,
                    lambda m: m.output_tok_s if m.num_ok else None, bar_width=bar_width),
        level_chart("TTFT p50 (ms) by concurrent streams", names, metrics,
                    lambda m: m.ttft_ms.p50, bar_width=bar_width, digits=0))
    return Group(Text(""), charts)
