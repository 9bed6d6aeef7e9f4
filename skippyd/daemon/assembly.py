"""The serving backend of a stage: tokenizer, llama.cpp runtime and the worker.

:class:`StageEngine` implements :class:`skippyd.http.backend.ServingBackend` for the
HTTP layer. It is created cheaply, then :meth:`StageEngine.load` does the slow part (slice
the model if needed, load it, start the worker) so the HTTP port can answer ``/health``
with 503 while the model loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from skippyd.checks import context_for_model
from skippyd.config import StageConfig
from skippyd.config.schema import parse_tensor_split
from skippyd.daemon.split import SplitStage, make_split
from skippyd.daemon.startup import StartupProgress
from skippyd.engine.prefix_cache import (
    LivePrefixCache,
    PrefixCacheSettings,
    PrefixCacheStats,
    settings_from_config,
)
from skippyd.engine.runtime import native
from skippyd.engine.runtime.contract import Runtime
from skippyd.engine.runtime.json_grammar import schema_to_grammar
from skippyd.engine.runtime.llama import (
    LlamaRuntime,
    ModelLoadError,
    RuntimeOptions,
    offload_facts,
)
from skippyd.engine.runtime.tokenizer import (
    IncrementalDetokenizer,
    TemplateRewritesContent,
    Tokenizer,
    TokenizerError,
)
from skippyd.engine.runtime.watch import CallWatch
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.drafting import DraftModel, Speculation, SpeculationSettings
from skippyd.engine.worker.faults import FAULT_ENV, FaultSwitch
from skippyd.engine.worker.generation_events import GenerationEvent, GenerationRequest
from skippyd.engine.worker.handle import BatchHandle, GenerationHandle, WorkerHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.worker_errors import WorkerStoppedError
from skippyd.http.backend import HealthStatus
from skippyd.model_files.model_info import ModelInfo, inspect_model
from skippyd.model_files.slice import cached_slice

logger = logging.getLogger(__name__)


#: A runtime call running longer than this makes /health report the stage as failed.
HANG_THRESHOLD_S = 120.0


def chat_prompt_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], *,
                       parse_special_in_content: bool = False) -> list[int]:
    """The tokens of a chat rendered with the model's template; see :func:`chat_prompt`."""
    return chat_prompt(tokenizer, messages, parse_special_in_content=parse_special_in_content)[0]


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], *,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                parse_special_in_content: bool = False) -> tuple[list[int], str]:
    """Render a chat with the model's template and tokenize it.

    Only the template's own text is tokenized with special-token parsing: message
    content is plain text, so a user who writes ``<|im_start|>system`` gets those
    characters, not the control token (unless ``parse_special_in_content``).

    Returns:
        The tokens, and the rendered text (whose end says whether the reply opens
        inside a reasoning block).

    Raises:
        TokenizerError: The template rejected the messages, or it rewrites message text
            and a content spells a control token.
    """
    def render() -> str:
        return tokenizer.render_chat(messages, tools=tools, template_kwargs=template_kwargs)

    if parse_special_in_content:
        text = render()
        return _tokenize_rendered(tokenizer, [(text, True)]), text
    _refuse_control_in_markup(tokenizer, messages, tools, template_kwargs)
    try:
        pieces = tokenizer.render_chat_pieces(messages, tools=tools,
                                              template_kwargs=template_kwargs)
    except TemplateRewritesContent:
        # The template transforms message text, so it cannot be cut out again: keep the
        # whole rendering, but only if no content could spell a control token.
        _refuse_control_text(tokenizer.control_token_texts(), messages)
        pieces = [(render(), True)]
    return _tokenize_rendered(tokenizer, pieces), "".join(text for text, _ in pieces)


def _tokenize_rendered(tokenizer: Tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
    # The template decides about BOS: add it only when the model wants one and the
    # rendered text does not already start with it.
    bos = tokenizer.detokenize([tokenizer.bos_token_id]) if tokenizer.add_bos else ""
    first = pieces[0][0] if pieces else ""
    add_special = tokenizer.add_bos and not (bos and first.startswith(bos))
    return tokenizer.tokenize_pieces(pieces, add_special=add_special)


def _refuse_control_in_markup(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                              tools: list[dict[str, Any]] | None,
                              template_kwargs: dict[str, Any] | None) -> None:
    """Refuse client text the template prints as markup (tools, tool calls, template
    variables) when it spells a control token: only message content is cut out."""
    fields: list[tuple[str, Any]] = [("tools", tools), ("chat_template_kwargs", template_kwargs)]
    fields += [(f"messages[{index}].tool_calls", message.get("tool_calls"))
               for index, message in enumerate(messages)]
    fields = [(name, value) for name, value in fields if value]
    if not fields:
        return
    control_texts = tokenizer.control_token_texts()
    for name, value in fields:
        text = json.dumps(value, ensure_ascii=False)
        for control in control_texts:
            if control in text:
                raise TokenizerError(f"{name} contains the control token text {control!r}, "
                                     "which the chat template would print as markup")


def _refuse_control_text(control_texts: frozenset[str], messages: list[dict[str, Any]]) -> None:
    """Raise naming the first message whose content contains a control token's text."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            continue
        for text in control_texts:
            if text in content:
                raise TokenizerError(
                    f"messages[{index}].content contains the control token text {text!r}, "
                    "which this model's chat template cannot keep apart from its markup")


class StartupError(Exception):
    """The stage could not start (bad model, unsupported topology...)."""


def runtime_options(config: StageConfig, model_path: Path) -> RuntimeOptions:
    """The llama.cpp settings a stage config asks for."""
    rt = config.runtime
    return RuntimeOptions(
        model_path=str(model_path),
        lane_count=rt.lane_count,
        # Sized from the model (context_for_model) before any runtime is built.
        ctx_size=rt.ctx_size or 0,
        kv_unified=rt.kv_layout == "unified",
        n_batch=rt.n_batch,
        n_ubatch=rt.n_ubatch,
        threads=rt.threads,
        threads_batch=rt.threads_batch,
        cache_type_k=rt.cache_type_k,
        cache_type_v=rt.cache_type_v,
        flash_attn=rt.flash_attn,
        gpu_layers=rt.gpu_layers,
        main_gpu=rt.main_gpu,
        tensor_split=parse_tensor_split(rt.tensor_split) if rt.tensor_split else (),
        first_stage=config.is_first,
        final_stage=config.is_final,
    )


def open_draft_runtime(path: str, target: LlamaRuntime) -> LlamaRuntime:
    """The draft model of speculative decoding, with as many lanes and as much context as
    ``target`` (so every request it drafts for fits) and its threads.

    Raises:
        StartupError: It cannot be loaded, or its vocabulary is not ``target``'s.
    """
    options = dataclasses.replace(target.options, model_path=path, gpu_layers=0,
                                  main_gpu=0, tensor_split=(), load_progress=None)
    try:
        draft = LlamaRuntime(options)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise StartupError(f"speculative.draft_model_path: cannot load {path}: {exc}") from exc
    if draft.n_vocab != target.n_vocab:
        draft.close()
        raise StartupError(
            f"speculative.draft_model_path: its vocabulary has {draft.n_vocab} tokens, the "
            f"model's {target.n_vocab}; a draft model must share the model's vocabulary")
    return draft


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
        self.ctx_size = config.runtime.session_tokens or 0
        """Most tokens one request can hold; its lane's KV once the model is loaded."""
        self.kv_pool_tokens = config.runtime.ctx_size or 0
        """KV cells of all lanes together (as llama.cpp padded them, once loaded)."""
        self.offload = offload_facts(runtime_options(config, config.resolved_model_path))
        """What the stage asks of the GPU, and whether llama.cpp has a GPU backend."""
        self.arrivals = Arrivals()
        """Requests the HTTP layer is preparing: a burst stage 0's worker may wait for."""
        self.n_vocab = 0
        self.info: ModelInfo | None = None
        self._progress = progress
        self.startup = StartupProgress()
        """What :meth:`load` is doing, for systemd's start-up timeout and STATUS."""
        self._tokenizer: Tokenizer | None = None
        self._runtime: Runtime | None = None
        self._worker: WorkerHandle | None = None
        self._generations: GenerationHandle | None = None
        """Stage 0's worker (None on a later stage, whose worker runs the link's batches)."""
        self._draft: DraftModel | None = None
        """The draft model of speculative decoding, if it runs one."""
        self._split: SplitStage | None = None
        self._prefix_cache: LivePrefixCache | None = None
        self.hang_threshold_s = HANG_THRESHOLD_S
        self._state: HealthStatus = "loading"
        self._reason: str | None = "loading the model"
        self._lock = threading.Lock()

    def _speculation(self, local: LlamaRuntime) -> Speculation | None:
        """Stage 0's speculative decoding, or None when off. On a split pipeline stage 0
        drafts and the final stage verifies (``docs/stage-protocol.md``).

        Raises:
            StartupError: The draft model cannot be loaded or has another vocabulary.
        """
        spec = self.config.speculative
        if not spec.enabled:
            return None
        settings = SpeculationSettings(spec.mode, spec.min_draft, spec.max_draft,
                                       split_by_sequence=not local.shares_kv_pool)
        draft = None
        if spec.mode == "draft":
            assert spec.draft_model_path is not None  # the config rules require it
            self.startup.step("loading the draft model")
            draft = DraftModel(open_draft_runtime(spec.draft_model_path, local))
            self._draft = draft
        logger.info("stage %s: speculative decoding %s (%d-%d drafts per row, as they pay)",
                    self.config.stage.id, spec.mode, spec.min_draft, spec.max_draft)
        return Speculation(settings, local.max_session_tokens, draft)

    # -- lifecycle -------------------------------------------------------------------
    def load(self) -> None:
        """Slice (if needed) and load the model, then start the worker. Blocking.

        Raises:
            StartupError: the model cannot be served by this stage.
        """
        source = self.config.resolved_model_path
        self.startup.step("reading the model header")
        self.info = inspect_model(source)
        self.config, why = context_for_model(self.config, self.info)
        if why is not None:
            logger.info("stage %s: %s", self.config.stage.id, why)
        stage = self.config.stage
        self.startup.step(f"slicing layers {stage.layer_start}:{stage.layer_end}")
        path = cached_slice(source, stage.layer_start, stage.layer_end or self.info.n_layer,
                            self.config.runtime.slice_cache_dir, progress=self._slice_progress)
        if self.config.is_first:  # later stages of a split take rows, not text
            self._tokenizer = self._open_tokenizer(source)
            self.n_vocab = self._tokenizer.n_vocab
        cache_settings = self._prefix_cache_settings()
        self.startup.step("loading the model")
        options = runtime_options(self.config, path)
        local = LlamaRuntime(dataclasses.replace(options, load_progress=self.startup.advance))
        self.offload = local.offload
        self.startup.step("starting the worker")
        faults = self._fault_switch()
        self._split = make_split(self.config, local, self.telemetry.publish)
        progress = local.compute_progress
        self._runtime = local if self._split is None else self._split.runtime
        self._runtime.watch = CallWatch(None if progress is None else progress.count)
        self._prefix_cache = self._make_prefix_cache(cache_settings, self._runtime)
        settings = WorkerSettings.for_stage(
            self.config, self._runtime,
            self.info.recurrent_bytes(stage.layer_start, stage.layer_end))
        if self.config.is_first:
            speculation = self._speculation(local)
            self._worker = self._generations = GenerationHandle(
                self._runtime, settings, telemetry=self.telemetry,
                prefix_cache=self._prefix_cache, faults=faults, arrivals=self.arrivals,
                speculation=speculation)
            self.ctx_size = self._generations.max_session_tokens
        else:
            self._worker = BatchHandle(self._runtime, settings, telemetry=self.telemetry,
                                       faults=faults)
            self.ctx_size = self._runtime.max_session_tokens
        self._worker.on_failure(self._worker_failed)
        self.kv_pool_tokens = self._runtime.kv_pool_tokens
        self._start_split()
        self._set_state("ok", None)
        layout = ("sharing one pool of" if self._runtime.shares_kv_pool
                  else "with a stream each of")
        logger.info("stage %s ready: %s layers %d:%s, %d lanes %s %d KV cells, up to %d "
                    "tokens per request", stage.id, self.model_id, stage.layer_start,
                    stage.layer_end, self._runtime.lane_count, layout,
                    self.kv_pool_tokens if self._runtime.shares_kv_pool
                    else self.kv_pool_tokens // max(1, self._runtime.lane_count),
                    self.ctx_size)
        logger.info("stage %s fast paths: %s", stage.id, native.describe_fast_paths())
        self._log_offload()
        missing = native.helpers().missing
        if missing is not None and not self.config.is_final:
            logger.warning("stage %s captures its layer output with a Python callback (native "
                           "helpers: %s): each step can take many times longer; reinstall "
                           "skippyd where a C compiler is available", stage.id, missing)

    def _log_offload(self) -> None:
        layers, backend = self.offload["gpu_layers"], self.offload["gpu_backend"]
        stage_id = self.config.stage.id
        if layers and not backend:
            logger.warning("stage %s: runtime.gpu_layers = %s, but this llama.cpp build has no "
                           "GPU backend: the model runs on the CPU (README, \"GPUs\", says how "
                           "to build llama-cpp-python for one)", stage_id, layers)
        elif layers:
            split = self.offload["tensor_split"]
            logger.info("stage %s offloads %s layers to the GPU (main GPU %s%s)", stage_id,
                        "all" if layers == -1 else layers, self.offload["main_gpu"],
                        f", split {split}" if split else "")
        elif backend:
            logger.info("stage %s runs on the CPU; this llama.cpp build can offload to a GPU: "
                        "set runtime.gpu_layers (-1 for all layers)", stage_id)

    @staticmethod
    def _fault_switch() -> FaultSwitch:
        """The test fault switch ``SKIPPYD_FAULT`` arms (none in production)."""
        try:
            return FaultSwitch.parse(os.environ.get(FAULT_ENV))
        except ValueError as exc:
            raise StartupError(str(exc)) from None

    def _worker_failed(self, reason: str) -> None:
        """The worker died (its thread calls this): the stage is failed for good."""
        self._set_state("failed", reason)

    def on_worker_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once if the worker dies, from the worker's thread
        (at once if it already has). Quick, never blocking. Only once loaded."""
        worker = self._worker
        if worker is not None:
            worker.on_failure(listener)

    def announce_failure(self, reason: str) -> None:
        """Tell the split chain's other stages that this stage failed (an ERROR frame
        before the link closes); nothing for an unsplit stage. May block briefly."""
        split = self._split
        if split is not None:
            split.announce_failure(reason)

    def _slice_progress(self, done: int, total: int) -> None:
        self.startup.advance(done / total if total else 1.0)
        if self._progress is not None:
            self._progress(done, total)

    def _open_tokenizer(self, source: Path) -> Tokenizer:
        http = self.config.http
        path = None if http is None else http.chat_template_file
        try:
            template = None if path is None else Path(path).read_text(encoding="utf-8")
            return Tokenizer(source, chat_template=template)
        except (OSError, UnicodeDecodeError, TokenizerError) as exc:
            raise StartupError(f"http.chat_template_file: {exc}") from exc

    def _prefix_cache_settings(self) -> PrefixCacheSettings | None:
        """The prefix cache runs on an unsplit stage of an attention-only model."""
        assert self.info is not None
        unsplit = self.config.is_first and self.config.is_final
        attention_only = self.info.recurrent_bytes() == 0
        reason = ("a split stage keeps no prefix cache yet" if not unsplit
                  else "recurrent state cannot be restored from a token prefix")
        return settings_from_config(self.config.kv_cache, supported=unsplit and attention_only,
                                    reason=reason)

    def _make_prefix_cache(self, settings: PrefixCacheSettings | None,
                           runtime: Runtime) -> LivePrefixCache | None:
        """The cache over the worker's runtime, whose lanes hold its entries."""
        if settings is None or not runtime.keeps_lane_kv:
            return None
        stage = self.config.stage
        return LivePrefixCache(
            runtime, settings, stage_index=stage.index, publish=self.telemetry.publish,
            namespace=f"{self.model_id}:{stage.layer_start}-{stage.layer_end}",
        )

    def _start_split(self) -> None:
        if self._split is None or self._worker is None:
            return
        try:
            self._split.start(self._worker)
        except OSError as exc:
            raise StartupError(f"link.listen: cannot listen on {self.config.link.listen}: "
                               f"{exc}") from exc

    @property
    def link_address(self) -> tuple[str, int] | None:
        """The bound stage-link address of a split stage, if it listens."""
        return None if self._split is None else self._split.link_address

    def link_status(self) -> dict[str, Any] | None:
        """The link counters of a split stage (what its STATUS reply carries).

        None for a stage serving the whole model, before its runtime is loaded and
        after close. Never waits on the worker or the network (the snapshot calls it).
        """
        split = self._split
        return None if split is None else split.link_status()

    def fail(self, reason: str) -> None:
        self._set_state("failed", reason)

    def begin_drain(self) -> None:
        """New generations are refused from now on; running ones go on."""
        if self._state == "ok":
            self._set_state("draining", "shutting down")

    def close(self) -> None:
        """Stop the worker (failing what it still holds) and free llama.cpp. Idempotent."""
        with self._lock:
            worker, runtime, tokenizer = self._worker, self._runtime, self._tokenizer
            self._worker = self._runtime = self._tokenizer = self._generations = None
            split, self._split = self._split, None
        if split is not None:  # first: requests waiting on the pipeline fail promptly
            split.close()
        if worker is not None:
            worker.close()
        draft, self._draft = self._draft, None
        if draft is not None:  # after the worker, its only caller
            draft.close()
        if runtime is not None:
            runtime.close()
        if tokenizer is not None:
            tokenizer.close()

    def _set_state(self, state: HealthStatus, reason: str | None) -> None:
        with self._lock:
            self._state, self._reason = state, reason

    @property
    def worker(self) -> WorkerHandle | None:
        return self._worker

    # -- ServingBackend --------------------------------------------------------------
    def runtime_busy_for(self) -> float:
        """Seconds the worker has been inside the current runtime call (0 when idle)."""
        runtime = self._runtime
        return 0.0 if runtime is None else runtime.watch.busy_for()

    def runtime_stalled_for(self) -> float:
        """Seconds the current runtime call has gone without computing (0 when idle)."""
        runtime = self._runtime
        return 0.0 if runtime is None else runtime.watch.stalled_for()

    def is_alive(self, hang_threshold_s: float) -> bool:
        """The worker thread runs and no runtime call is stuck (the watchdog's question).

        A call is stuck when llama.cpp computed nothing for ``hang_threshold_s``; a long
        call that keeps computing (a big prefill on a CPU) is alive.
        """
        worker = self._worker
        if worker is None or worker.failure is not None:
            return False
        return worker.thread.is_alive() and self.runtime_stalled_for() < hang_threshold_s

    def health(self) -> tuple[HealthStatus, str | None]:
        worker = self._worker
        if self._state == "ok" and worker is not None and worker.failure is not None:
            return "failed", worker.failure
        stalled = self.runtime_stalled_for()
        if self._state == "ok" and stalled >= self.hang_threshold_s:
            return "failed", (f"runtime call running for {self.runtime_busy_for():.0f} s,"
                              f" no progress for {stalled:.0f} s (hung?)")
        split = self._split
        degraded = split.degraded() if split is not None else None
        if self._state == "ok" and degraded is not None:
            return "degraded", degraded
        return self._state, self._reason

    @property
    def max_context_tokens(self) -> int:
        """What one sequence may hold: its lane's KV stream, once loaded."""
        return self.ctx_size

    @property
    def local_sampling(self) -> bool:
        """This process samples (not stage 0 of a split pipeline)."""
        return self.config.is_final

    @property
    def chat_template(self) -> str | None:
        tokenizer = self._tokenizer
        return None if tokenizer is None else tokenizer.chat_template

    def describe(self) -> dict[str, Any]:
        """Facts for ``/props`` and ``/v1/models``."""
        stage, info, tokenizer = self.config.stage, self.info, self._tokenizer
        facts: dict[str, Any] = {
            "lane_count": self.config.runtime.lane_count,
            "layer_start": stage.layer_start,
            "layer_end": stage.layer_end or (info.n_layer if info else None),
            "n_layer": info.n_layer if info else None,
            "model_path": str(self.config.resolved_model_path),
            "fast_paths": native.fast_paths(),
            "offload": self.offload,
        }
        if tokenizer is not None:
            facts["bos_token"] = tokenizer.detokenize([tokenizer.bos_token_id])
            facts["eos_token"] = tokenizer.detokenize([tokenizer.eos_token_id])
        return facts

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = False) -> list[int]:
        return self._require_tokenizer().tokenize(text, add_special=add_special,
                                                  parse_special=parse_special)

    def render_chat(self, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        return self._require_tokenizer().render_chat(
            messages, tools=tools, template_kwargs=template_kwargs,
            add_generation_prompt=add_generation_prompt)

    def detokenize(self, tokens: list[int]) -> str:
        return self._require_tokenizer().detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self._require_tokenizer().token_bytes(token)

    def check_grammar(self, grammar: str) -> None:
        self._require_tokenizer().check_grammar(grammar)

    def schema_grammar(self, schema: dict[str, Any], root: str | None = None) -> str:
        grammar = schema_to_grammar(schema, root)
        self._require_tokenizer().check_grammar(grammar)
        return grammar

    def chat_tokens(self, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """Render and tokenize a chat; see :func:`chat_prompt`."""
        http = self.config.http
        return chat_prompt(self._require_tokenizer(), messages, tools=tools,
                           template_kwargs=template_kwargs,
                           parse_special_in_content=bool(
                               http is not None and http.parse_special_in_content))

    def detokenizer(self) -> IncrementalDetokenizer:
        return self._require_tokenizer().detokenizer()

    def arriving(self) -> AbstractContextManager[None]:
        return self.arrivals.arriving()

    def submit(self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]) -> None:
        worker = self._generations
        if worker is None or self._state != "ok":
            raise WorkerStoppedError(f"stage is {self._state}: {self._reason}")
        worker.submit_generation(request, on_event)

    def cancel(self, request_id: str) -> None:
        worker = self._generations
        if worker is not None:
            worker.cancel(request_id)

    def prefix_cache_stats(self) -> dict[str, int | float]:
        """``hits, misses, hit_rate, matched_tokens, bytes_resident, bytes_host, evictions``."""
        cache = self._prefix_cache
        return (PrefixCacheStats() if cache is None else cache.stats()).as_dict()

    def _require_tokenizer(self) -> Tokenizer:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise WorkerStoppedError("the model is not loaded")
        return tokenizer
