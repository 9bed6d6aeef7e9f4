"""What a stage of a split pipeline adds to the engine and the daemon.

:func:`make_split` gives the engine the runtime its worker drives and the link
machinery around it: on stage 0 a :class:`PipelineRuntime` over the local slice and a
:class:`ChainLink` to stage 1; on a later stage the local runtime (metered) and a
:class:`StageLinkServer` that feeds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from skippyd.config import StageConfig
from skippyd.engine.runtime.contract import Runtime
from skippyd.engine.runtime.llama import LlamaRuntime
from skippyd.engine.runtime.pipeline import MAX_INFLIGHT_BATCHES, PipelineRuntime
from skippyd.engine.runtime.pipeline_types import StageTimeline
from skippyd.engine.runtime.step_probe import time_decode_steps
from skippyd.engine.telemetry_events import TelemetryPayload
from skippyd.engine.worker.handle import BatchHandle, WorkerHandle
from skippyd.link.dialer import ChainIdentity, ChainLink
from skippyd.link.listener import (
    LISTENER_COUNTERS,
    StageFacts,
    StageLinkServer,
    status_body,
)
from skippyd.link.tls import LinkTls

logger = logging.getLogger(__name__)


def _facts(config: StageConfig, runtime: LlamaRuntime, tls: LinkTls | None) -> StageFacts:
    stage, link, downstream = config.stage, config.link, config.downstream
    return StageFacts(
        stage_id=stage.id, stage_index=stage.index, layer_start=stage.layer_start,
        layer_end=stage.layer_end or stage.layer_start + runtime.info.n_layer,
        model_id=stage.model_id, n_embd=runtime.n_embd, lanes=runtime.lane_count,
        session_tokens=runtime.max_session_tokens, max_batch_tokens=runtime.max_batch_tokens,
        is_first=config.is_first,
        is_final=config.is_final, secret=(link.secret or "").encode(),
        max_frame_bytes=link.max_frame_bytes,
        status_secret=link.status_secret.encode() if link.status_secret else None,
        max_chains=link.max_chains,
        downstream_id=downstream.stage_id if downstream else None,
        downstream=downstream.address if downstream else None,
        advertise=link.advertise,
        upstream_id=config.upstream.stage_id if config.upstream else None,
        tls=tls,
        silence_timeout_s=link.silence_timeout_s,
        connect_timeout_s=link.connect_timeout_s,
    )


class SplitStage:
    """The split-pipeline part of one stage; created by :func:`make_split`.

    Attributes:
        runtime: What the stage's worker drives.
    """

    def __init__(self, config: StageConfig, local: LlamaRuntime,
                 publish: Callable[[TelemetryPayload], None] | None = None) -> None:
        if not config.link.secret:
            raise ValueError("link.secret: required on a stage of a split pipeline")
        self.config = config
        self.started_at = time.monotonic()
        # Raises TlsSetupError (a ValueError naming the key) for unusable files.
        tls = LinkTls.from_config(config.link, config.stage.id)
        if tls is not None:
            logger.info("link: TLS 1.3 on every connection, as %s, trusting only the CA "
                        "in %s", config.stage.id, tls.files.ca)
        self._facts = _facts(config, local, tls)
        self._worker: WorkerHandle | None = None
        self._server: StageLinkServer | None = None
        self.link: ChainLink | None = None
        self.pipeline: PipelineRuntime | None = None
        self._local = local
        self.timeline: StageTimeline = local.timeline
        """A later stage's per-batch timeline (stage 0's lives in its pipeline runtime):
        its runtime adds compute and the rest of each call, the link the rest."""
        if config.is_first:
            self.link = ChainLink(ChainIdentity.from_config(
                config, local.n_embd, local.lane_count, local.max_session_tokens,
                local.max_batch_tokens, tls), publish)
            groups = config.runtime.pipeline_decode_groups
            self.pipeline = PipelineRuntime(local, self.link, decode_groups=groups,
                                            step_ms=None if groups else _step_costs(local))
            self.runtime: Runtime = self.pipeline
        else:
            self.runtime = local

    def start(self, worker: WorkerHandle) -> None:
        """Open the link listener (if configured) and, on stage 0, start dialling.

        ``worker`` is stage 0's generation worker, or a later stage's batch worker (the
        one the link's batches run on).

        Raises:
            OSError: ``link.listen`` cannot be bound.
        """
        self._worker = worker
        listen = self.config.link.listen_address
        if listen is not None:
            batches = worker if isinstance(worker, BatchHandle) else None
            server = StageLinkServer(self._facts, batches, self.status, self.timeline)
            server.bind(listen)
            server.start()
            self._server = server
        if self.link is not None and self.pipeline is not None:
            self.link.start(self.pipeline)

    @property
    def link_address(self) -> tuple[str, int] | None:
        return None if self._server is None else self._server.address

    def degraded(self) -> str | None:
        """Why the pipeline cannot serve right now, or None."""
        if self.link is None or self.link.is_up:
            return None
        return f"pipeline degraded: {self.link.down_reason()}"

    def announce_failure(self, reason: str) -> None:
        """Stage 0's worker died: tell the chain with an ERROR frame (best effort).

        A later stage needs nothing here: its failed batches already went on as ERROR
        frames, and so does every batch it receives from now on.
        """
        if self.link is not None:
            self.link.send_error(f"{self.config.stage.id}: {reason}")

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        if self._server is not None:
            self._server.close()

    def status(self) -> dict[str, Any]:
        """The stage's own counters, which its link listener adds to every STATUS reply.

        Reads counters only (the worker's last published stats, the pipeline's and the
        chain's totals), so the control snapshot may call it on any thread.
        """
        worker = self._worker
        sessions = 0 if worker is None else worker.stats().active_runtime_sessions
        status: dict[str, Any] = {"uptime_s": time.monotonic() - self.started_at,
                                  "active_sessions": sessions}
        if self.pipeline is None:
            status["busy_s"] = self._local.busy_s
            status["timeline"] = self.timeline.as_dict()
        if self.pipeline is not None and self.link is not None:
            counters = self.pipeline.counters
            status.update(busy_s=counters.local_compute_s, batches_sent=counters.batches_sent,
                          lookahead_steps=counters.lookahead_steps,
                          lookahead_hits=counters.lookahead_hits,
                          lookahead_retracted=counters.lookahead_retracted,
                          chain=self.link.status(),
                          timeline=_stage0_timeline(counters.timeline, self.link.timeline),
                          links=self.link.links(),
                          inflight_batches=self.pipeline.inflight_batches,
                          max_inflight_batches=MAX_INFLIGHT_BATCHES,
                          reply_ms=_ms(counters.reply_last_s),
                          reply_avg_ms=_ms(counters.reply_avg_s),
                          decode_step_ms=list(self.pipeline.step_ms))
        return status

    def link_status(self) -> dict[str, Any]:
        """What a STATUS reply of this stage carries, for the control snapshot.

        A stage 0 without ``link.listen`` has no listener: its listener counters are
        zero, so every split stage reports the same keys.
        """
        server = self._server
        if server is not None:
            return server.status()
        return status_body(self._facts, 0, dict.fromkeys(LISTENER_COUNTERS, 0), self.status())


def _step_costs(local: LlamaRuntime) -> list[float]:
    """Stage 0's decode step costs by rows, timed once before it serves, and logged."""
    started = time.perf_counter()
    costs = time_decode_steps(local)
    logger.info("pipeline: a decode step of 1-%d rows takes %s ms on this stage (timed in "
                "%.1f s); decode rows go in batches by these costs", len(costs),
                " / ".join(f"{ms:.0f}" for ms in costs), time.perf_counter() - started)
    return costs


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _stage0_timeline(pipeline: StageTimeline, link: StageTimeline) -> dict[str, float]:
    """Stage 0's timeline: compute and waits from the pipeline, encode and send from
    the link that serialises and writes the batches."""
    timeline = pipeline.as_dict()
    timeline.update(encode_s=link.encode_s, send_s=link.send_s)
    return timeline


def make_split(config: StageConfig, local: LlamaRuntime,
               publish: Callable[[TelemetryPayload], None] | None = None) -> SplitStage | None:
    """The split part of a stage, or None for a stage serving the whole model
    (``publish``: where stage 0's chain tells of going up and down)."""
    if config.is_first and config.is_final:
        return None
    return SplitStage(config, local, publish)


def slice_progress() -> Callable[[int, int], None]:
    """A progress callback drawing a rich bar on stderr while a slice is written."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "progress" not in state:
            progress = Progress("[progress.description]{task.description}", BarColumn(),
                                DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True), transient=False)
            progress.start()
            state["progress"] = progress
            state["task"] = progress.add_task("slicing the stage model", total=total)
        state["progress"].update(state["task"], completed=done, total=total)
        if done >= total:
            state.pop("progress").stop()

    return update
