"""The serving backend of a stage: tokenizer, llama.cpp runtime and the scheduler worker.

:class:`StageEngine` implements :class:`skippyd.server.backend.ServingBackend` for the
HTTP layer. It is created cheaply, then :meth:`StageEngine.load` does the slow part (slice
the model if needed, load it, start the worker) so the HTTP port can answer ``/health``
with 503 while the model loads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from skippyd.config import StageConfig
from skippyd.engine.gguf_tools import ModelInfo, cached_slice, inspect_model
from skippyd.engine.runtime import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime_watch import WatchedRuntime
from skippyd.engine.telemetry import TelemetryHub
from skippyd.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from skippyd.engine.worker import IterationScheduler
from skippyd.engine.worker_types import GenerationRequest, SchedulerEvent, SchedulerStoppedError
from skippyd.server.backend import HealthStatus

logger = logging.getLogger(__name__)


#: A runtime call running longer than this makes /health report the stage as failed.
HANG_THRESHOLD_S = 120.0


class StartupError(Exception):
    """The stage could not start (bad model, unsupported topology...)."""


def runtime_options(config: StageConfig, model_path: Path) -> RuntimeOptions:
    """The llama.cpp settings a stage config asks for."""
    rt = config.runtime
    return RuntimeOptions(
        model_path=str(model_path),
        lane_count=rt.lane_count,
        ctx_size=rt.ctx_size,
        n_batch=rt.n_batch,
        n_ubatch=rt.n_ubatch,
        threads=rt.threads,
        threads_batch=rt.threads_batch,
        cache_type_k=rt.cache_type_k,
        cache_type_v=rt.cache_type_v,
        flash_attn=rt.flash_attn,
        first_stage=config.is_first,
        final_stage=config.is_final,
    )


class StageEngine:
    """Everything a stage serves with, behind the HTTP layer's backend protocol.

    Args:
        config: A config whose layer range was checked against the model.
        telemetry: The hub the worker publishes to (the control socket reads it).
        progress: Called with (bytes done, bytes total) while a slice is written.
    """

    def __init__(self, config: StageConfig, *, telemetry: TelemetryHub | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or TelemetryHub()
        self.model_id = config.served_model_id
        self.ctx_size = config.runtime.ctx_size
        self.n_vocab = 0
        self.info: ModelInfo | None = None
        self._progress = progress
        self._tokenizer: Tokenizer | None = None
        self._runtime: WatchedRuntime | None = None
        self._scheduler: IterationScheduler | None = None
        self.hang_threshold_s = HANG_THRESHOLD_S
        self._state: HealthStatus = "loading"
        self._reason: str | None = "loading the model"
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------
    def load(self) -> None:
        """Slice (if needed) and load the model, then start the worker. Blocking.

        Raises:
            StartupError: the model cannot be served by this stage.
        """
        if not (self.config.is_first and self.config.is_final):
            raise StartupError(
                "this stage has an upstream or downstream peer; serving a split pipeline"
                " needs the stage link, which this build does not provide yet"
            )
        source = self.config.resolved_model_path
        self.info = inspect_model(source)
        stage = self.config.stage
        path = cached_slice(source, stage.layer_start, stage.layer_end or self.info.n_layer,
                            self.config.runtime.slice_cache_dir, progress=self._progress)
        self._tokenizer = Tokenizer(source)
        self.n_vocab = self._tokenizer.n_vocab
        self._runtime = WatchedRuntime(LlamaRuntime(runtime_options(self.config, path)))
        rt = self.config.runtime
        self._scheduler = IterationScheduler(
            self._runtime,
            queue_capacity=rt.queue_capacity,
            continuous_batching=rt.continuous_batching,
            safe_mode=rt.safe_mode,
            n_batch=rt.n_batch,
            n_ubatch=rt.n_ubatch,
            recurrent_bytes_per_seq=self.info.recurrent_bytes(stage.layer_start, stage.layer_end),
            exports=not self.config.is_final,
            telemetry=self.telemetry,
        )
        self._set_state("ok", None)
        logger.info("stage %s ready: %s layers %d:%s, %d lanes, ctx %d", stage.id,
                    self.model_id, stage.layer_start, stage.layer_end, rt.lane_count,
                    self._runtime.kv_pool_tokens)

    def fail(self, reason: str) -> None:
        self._set_state("failed", reason)

    def begin_drain(self) -> None:
        """New generations are refused from now on; running ones go on."""
        if self._state == "ok":
            self._set_state("draining", "shutting down")

    def close(self) -> None:
        """Stop the worker (failing what it still holds) and free llama.cpp. Idempotent."""
        with self._lock:
            scheduler, runtime, tokenizer = self._scheduler, self._runtime, self._tokenizer
            self._scheduler = self._runtime = self._tokenizer = None
        if scheduler is not None:
            scheduler.close()
        if runtime is not None:
            runtime.close()
        if tokenizer is not None:
            tokenizer.close()

    def _set_state(self, state: HealthStatus, reason: str | None) -> None:
        with self._lock:
            self._state, self._reason = state, reason

    @property
    def scheduler(self) -> IterationScheduler | None:
        return self._scheduler

    # -- ServingBackend --------------------------------------------------------------
    def runtime_busy_for(self) -> float:
        """Seconds the worker has been inside the current runtime call (0 when idle)."""
        runtime = self._runtime
        return 0.0 if runtime is None else runtime.busy_for()

    def is_alive(self, hang_threshold_s: float) -> bool:
        """The worker thread runs and no runtime call is stuck (the watchdog's question)."""
        scheduler = self._scheduler
        if scheduler is None or scheduler.failure is not None:
            return False
        return scheduler.thread.is_alive() and self.runtime_busy_for() < hang_threshold_s

    def health(self) -> tuple[HealthStatus, str | None]:
        scheduler = self._scheduler
        if self._state == "ok" and scheduler is not None and scheduler.failure is not None:
            return "failed", scheduler.failure
        busy = self.runtime_busy_for()
        if self._state == "ok" and busy >= self.hang_threshold_s:
            return "failed", f"runtime call running for {busy:.0f} s (hung?)"
        return self._state, self._reason

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self._require_tokenizer().tokenize(text, add_special=add_special)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self._require_tokenizer().render_chat(messages)

    def tokenize_chat(self, text: str) -> list[int]:
        tokenizer = self._require_tokenizer()
        # The template decides about BOS: add it only when the model wants one and the
        # rendered text does not already start with it.
        bos = tokenizer.detokenize([tokenizer.bos_token_id]) if tokenizer.add_bos else ""
        add_special = tokenizer.add_bos and not (bos and text.startswith(bos))
        return tokenizer.tokenize(text, add_special=add_special, parse_special=True)

    def detokenizer(self) -> IncrementalDetokenizer:
        return self._require_tokenizer().detokenizer()

    def submit(self, request: GenerationRequest, on_event: Callable[[SchedulerEvent], None]) -> None:
        scheduler = self._scheduler
        if scheduler is None or self._state != "ok":
            raise SchedulerStoppedError(f"stage is {self._state}: {self._reason}")
        scheduler.submit_generation(request, on_event)

    def cancel(self, request_id: str) -> None:
        scheduler = self._scheduler
        if scheduler is not None:
            scheduler.cancel(request_id)

    def cached_prompt_tokens(self, request_id: str) -> int:
        return 0  # no prefix cache yet: every prompt token is computed

    def _require_tokenizer(self) -> Tokenizer:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise SchedulerStoppedError("the model is not loaded")
        return tokenizer
