"""The status snapshot: one JSON-ready dict describing a stage right now.

It is what ``{"op": "status"}`` answers on the control socket, what subscribers receive
every ``interval_ms`` and what ``skippyd status`` renders; its schema is part of the
control protocol (``docs/control-protocol.md``). Building one reads the worker's last
published :class:`~skippyd.engine.worker.worker_stats.WorkerStats` (one attribute read, no
lock shared with the worker), the request metrics and, on a split stage, the link's
counters; it never waits on the worker or the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from skippyd.config import StageConfig
from skippyd.engine.runtime.native import fast_paths
from skippyd.engine.worker.worker_stats import WorkerStats
from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)

class SnapshotEngine(Protocol):
    """What a snapshot reads from the stage engine (``StageEngine`` satisfies it)."""

    config: StageConfig
    model_id: str
    ctx_size: int
    offload: dict[str, Any]

    @property
    def worker(self) -> Any: ...

    def health(self) -> tuple[str, str | None]: ...

    def link_status(self) -> dict[str, Any] | None: ...


def build_snapshot(
    engine: SnapshotEngine, metrics: ServingMetrics, started_at: float
) -> dict[str, Any]:
    """The control-protocol snapshot of ``engine`` (schema in docs/control-protocol.md).

    Args:
        engine: The stage engine (loaded or not).
        metrics: The stage's request metrics.
        started_at: ``time.monotonic()`` when the daemon started (for ``uptime_s``).

    Returns:
        A dict of JSON types only.
    """
    worker = engine.worker
    stats: WorkerStats = worker.stats() if worker is not None else WorkerStats()
    status, reason = engine.health()
    lane_count = engine.config.runtime.lane_count
    return {
        "stage": _stage(engine),
        "uptime_s": max(0.0, time.monotonic() - started_at),
        "health": {"status": status, "reason": reason},
        "lane_count": lane_count,
        "lanes": lane_rows(stats, lane_count),
        "queues": {"waiting": stats.num_waiting, "commands": stats.command_queue_depth,
                   "direct": stats.direct_queue_depth},
        "wave": {"active_sessions": stats.active_runtime_sessions,
                 "batch_size": stats.max_direct_batch_size,
                 "fullness": float(stats.wave_fullness),
                 "full": stats.active_runtime_sessions >= stats.max_direct_batch_size},
        "kv": _kv(engine, metrics),
        "prefix_cache": metrics.prefix_cache(),
        "throughput": metrics.throughput(),
        "latency_ms": metrics.latency_ms(),
        "counters": _counters(stats, metrics),
        "speculation": {"mode": stats.speculation, "drafted": stats.num_drafted,
                        "accepted": stats.num_draft_accepted,
                        "acceptance": (stats.num_draft_accepted / stats.num_drafted
                                       if stats.num_drafted else 0.0)},
        "scheduler": {"last_step_ms": stats.last_step_ms,
                      "last_overhead_ms": stats.last_overhead_ms,
                      "step_target_ms": stats.step_target_ms,
                      "overhead_ratio": metrics.overhead_ratio()},
        "link": engine.link_status(),
        "fast_paths": fast_paths(),
    }


def snapshot_source(
    engine: SnapshotEngine, metrics: ServingMetrics, started_at: float | None = None
) -> Callable[[], dict[str, Any]]:
    """A zero-argument snapshot callable, as :class:`ControlServer` wants one."""
    since = time.monotonic() if started_at is None else started_at
    return lambda: build_snapshot(engine, metrics, since)


def lane_rows(stats: WorkerStats, lane_count: int) -> list[dict[str, Any]]:
    """One row per lane, busy ones from the worker and the rest ``idle``."""
    busy = {info.lane: info for info in getattr(stats, "lanes", ())}
    rows = []
    for lane in range(max(lane_count, max(busy, default=-1) + 1)):
        info = busy.get(lane)
        if info is None:
            rows.append({"lane": lane, "request_id": "", "phase": "idle",
                         "prompt_tokens": 0, "generated_tokens": 0})
        else:
            rows.append({"lane": lane, "request_id": str(info.request_id),
                         "phase": str(info.phase), "prompt_tokens": int(info.prompt_tokens),
                         "generated_tokens": int(info.generated_tokens)})
    return rows


def _stage(engine: SnapshotEngine) -> dict[str, Any]:
    config = engine.config
    stage = config.stage
    info = getattr(engine, "info", None)
    layer_end = stage.layer_end if stage.layer_end is not None else (
        info.n_layer if info is not None else 0)
    return {"id": stage.id, "index": stage.index, "model": engine.model_id,
            "layer_start": stage.layer_start, "layer_end": layer_end,
            "is_first": config.is_first, "is_final": config.is_final,
            "offload": engine.offload}


def _kv(engine: SnapshotEngine, metrics: ServingMetrics) -> dict[str, Any]:
    used, total = metrics.kv_cells()
    return {"cells_used": used, "cells_total": total,
            "usage": used / total if total else 0.0,
            "layout": engine.config.runtime.kv_layout, "request_max_tokens": engine.ctx_size}


def _counters(stats: WorkerStats, metrics: ServingMetrics) -> dict[str, int]:
    return {
        "finished": metrics.outcomes["finished"],
        "failed": metrics.outcomes["failed"],
        "cancelled": metrics.outcomes["cancelled"],
        "rejected": sum(metrics.rejections.values()),
        "preempted": stats.num_preempted,
        "iterations": stats.num_iterations,
        "direct_iterations": stats.num_direct_iterations,
        "prompt_tokens": metrics.num_prompt_tokens,
        "generation_tokens": metrics.num_generated_tokens,
    }
