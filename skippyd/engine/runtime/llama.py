"""One llama.cpp context: lanes, sessions and batched iterations.

One model and one context with ``n_seq_max = lane_count``; every call to
:meth:`LlamaRuntime.run_iteration` is one ``llama_decode`` holding the rows of many
sessions, each bound to a lane (a sequence id) while it is active. The lanes share one
KV pool of ``ctx_size`` cells (``runtime.kv_layout = "unified"``: a session may use all
of it) or have a stream each of ``ctx_size / lane_count`` cells (``per_lane``, the
default); a lane keeps its KV after its session ends, for the prefix cache
(:mod:`skippyd.engine.runtime.lanes`). With a stream per lane llama.cpp keeps rows in one
micro-batch only for consecutive lanes, so rows go in lane order and a lane left out
between two gets a throw-away filler row (``LlamaRuntime._padding_lanes``).
``docs/scheduler.md``, *KV memory*, has the trade-off. A non-final stage runs an
iteration's rows in calls of at most ``LlamaRuntime.rows_per_call`` rows
(:func:`output_window` says why). No policy lives here; only the worker thread may call
a runtime.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.config.schema import FLASH_ATTN_TYPE_IDS, GGML_TYPE_IDS
from skippyd.engine.runtime import native, wake_decode
from skippyd.engine.runtime.constrained import GrammarError
from skippyd.engine.runtime.contract import (
    LLAMA_MAX_SEQ,
    ComputeHook,
    DecodeFailedError,
    InvalidIterationError,
    IterationOutput,
    IterationRequest,
    IterationSample,
    KvSlotUnavailableError,
    LanesBusyError,
    RowPhase,
    SamplingConfig,
    SessionAlignment,
)
from skippyd.engine.runtime.host_state import HostState, HostStates
from skippyd.engine.runtime.lanes import Lane, LaneTable
from skippyd.engine.runtime.llama_ext import (
    ensure_backend,
    make_layer_capture,
    stream_split_order,
)
from skippyd.engine.runtime.mapped_pages import release_file_pages
from skippyd.engine.runtime.pipeline_types import StageTimeline
from skippyd.engine.runtime.progress import make_compute_progress
from skippyd.engine.runtime.sampling import SamplerChain, is_plain_greedy
from skippyd.engine.runtime.token_logprobs import (
    output_logits,
    prompt_row_logprobs,
    row_logits,
    token_logprob,
)
from skippyd.engine.runtime.watch import CallWatch, unwatched
from skippyd.model_files.model_info import inspect_model

logger = logging.getLogger(__name__)

# The config's tables name llama.cpp's ggml_type and flash-attention values once.
KV_CACHE_TYPES = GGML_TYPE_IDS
FLASH_ATTN_TYPES = FLASH_ATTN_TYPE_IDS
_GREEDY = SamplingConfig(temperature=0.0)
#: A lane left out between the rows of a batch gets a filler row when the batch has at
#: least this many rows per such lane (see ``LlamaRuntime._padding_lanes``).
PAD_ROWS_PER_HOLE = 3


class ModelLoadError(Exception):
    """llama.cpp could not load the model or create the context."""


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How to open a runtime. ``first_stage``/``final_stage`` describe a layer slice."""

    model_path: str
    lane_count: int = 4
    ctx_size: int = 4096
    kv_unified: bool = False
    """One KV pool shared by every lane, instead of one stream per lane."""
    n_batch: int = 2048
    n_ubatch: int = 512
    threads: int | None = None
    threads_batch: int | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    gpu_layers: int = 0
    """Layers offloaded to the GPU (llama.cpp's ``n_gpu_layers``; -1: all)."""
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    """Proportions of the offloaded layers per GPU; empty: llama.cpp's choice."""
    first_stage: bool = True
    final_stage: bool = True
    load_progress: Callable[[float], None] | None = field(default=None, compare=False)
    """Called with the share of the model's tensors loaded (0..1) while llama.cpp loads."""

    def validate(self) -> None:
        if not 1 <= self.lane_count <= LLAMA_MAX_SEQ:
            raise ValueError(
                f"lane_count: must be within 1..{LLAMA_MAX_SEQ} (got {self.lane_count})")
        if self.ctx_size < 1 or self.n_batch < 1 or not 1 <= self.n_ubatch <= self.n_batch:
            raise ValueError("ctx_size, n_batch must be >= 1 and 1 <= n_ubatch <= n_batch")
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in KV_CACHE_TYPES:
                raise ValueError(f"{name}: unknown KV cache type {getattr(self, name)!r}")
        if self.flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn: must be one of {sorted(FLASH_ATTN_TYPES)}")
        if self.gpu_layers < -1 or self.main_gpu < 0:
            raise ValueError("gpu_layers must be >= -1 and main_gpu >= 0")
        if len(self.tensor_split) > int(L.llama_max_devices()):
            raise ValueError(f"tensor_split: at most {int(L.llama_max_devices())} devices")


@dataclass(slots=True)
class ModelParams:
    """``llama_model_params`` for a load, with the tensor-split array it points to."""

    struct: L.llama_model_params
    tensor_split_keepalive: ctypes.Array | None


def model_params(options: RuntimeOptions) -> ModelParams:
    """The ``llama_model_params`` a runtime loads its model with (GPU offload included)."""
    params = L.llama_model_default_params()
    params.n_gpu_layers = options.gpu_layers
    params.main_gpu = options.main_gpu
    split = None
    if options.tensor_split:
        split = (ctypes.c_float * int(L.llama_max_devices()))(*options.tensor_split)
        params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
    return ModelParams(params, split)


def offload_facts(options: RuntimeOptions) -> dict[str, object]:
    """What a stage asked of the GPU, and whether llama.cpp can offload at all."""
    return {"gpu_layers": options.gpu_layers, "main_gpu": options.main_gpu,
            "tensor_split": list(options.tensor_split),
            "gpu_backend": bool(L.llama_supports_gpu_offload())}


@dataclass(slots=True)
class _BatchLayout:
    """Where each request of one batch sits, as :meth:`LlamaRuntime._fill_batch` wrote it
    (lists in request order)."""

    first_rows: list[int]
    """The batch row of each request's first token."""
    sample_rows: list[int]
    """The batch row to sample per request (its last)."""
    sample_outputs: list[int]
    """The output index of that row (its place among the rows that produce logits)."""
    n_outputs: int = 0
    """Rows that produce logits."""


class LlamaRuntime:
    """Lanes and batched iterations over one llama.cpp context.

    It owns the context and composes what acts on it: the lanes and their sessions
    (:class:`~skippyd.engine.runtime.lanes.LaneTable`) and saved states in host memory
    (:class:`~skippyd.engine.runtime.host_state.HostStates`); its methods are the
    :class:`~skippyd.engine.runtime.contract.Runtime` protocol, the prefix cache's lane
    operations included. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, options: RuntimeOptions) -> None:
        options.validate()
        ensure_backend()
        self.options = options
        self.info = inspect_model(options.model_path)
        self.n_embd = self.info.n_embd
        self.offload = offload_facts(options)
        """What was asked of the GPU and whether this llama.cpp build has one."""
        self._model = self._load_model(options)
        self._capture = (
            None if options.final_stage
            else make_layer_capture(self.info.n_layer, self.info.n_embd, options.n_batch)
        )
        self._ctx = self._new_context(options)
        released = release_file_pages(options.model_path)
        if released:
            logger.info("%s: %d MiB of the file's pages left the process's memory (read again"
                        " only where the model computes from them in place)",
                        os.path.basename(options.model_path), released >> 20)
        # Counts computed graph nodes, so a long call that progresses is not "hung".
        self.compute_progress = make_compute_progress()
        if self.compute_progress is not None:
            self.compute_progress.install(self._ctx)
        self._compute_hook: ComputeHook | None = None
        self._mem = L.llama_get_memory(self._ctx)
        # llama.cpp pads each lane's stream (to 256 cells); the padded sizes are real.
        self.n_ctx = int(L.llama_n_ctx(self._ctx))
        self.lane_capacity_tokens = int(L.llama_n_ctx_seq(self._ctx))
        """Most tokens one session can hold: its lane's stream."""
        # llama.cpp caps a call at the context it was asked for: n_batch may be smaller.
        self.n_batch = int(L.llama_n_batch(self._ctx))
        self.n_ubatch = int(L.llama_n_ubatch(self._ctx))
        vocab = L.llama_model_get_vocab(self._model)
        self._vocab = vocab
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self._eog_tokens = tuple(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(vocab, t))
        self._batch = L.llama_batch_init(
            options.n_batch, 0 if options.first_stage else self.n_embd, 1
        )
        offloads = options.gpu_layers != 0 and bool(self.offload["gpu_backend"])
        self.rows_per_call = (self.n_batch if options.final_stage
                              else output_window(self.n_vocab, self.n_ubatch if offloads else 0))
        """Most rows one ``llama_decode`` holds (an iteration may take several calls)."""
        self._host_states = HostStates(self._ctx)
        self._lanes = LaneTable(self._mem, self._host_states, options.lane_count,
                                unified=options.kv_unified)
        self._padding: list[Lane] = []
        self.watch: CallWatch = unwatched()
        """Marks each batched call (the daemon installs one that reports hangs)."""
        self.timeline = StageTimeline()
        """Seconds in llama_decode (``compute_s``) and in the rest of the calls."""
        self.decode_calls = 0
        """``llama_decode`` calls made (one per iteration; a non-final stage may make several)."""

    # -- lifecycle -------------------------------------------------------------------
    @staticmethod
    def _load_model(options: RuntimeOptions):
        path, progress = options.model_path, options.load_progress
        # Holds the tensor-split array too, for as long as the load reads it.
        params = model_params(options)
        if progress is not None:
            @L.llama_progress_callback
            def on_progress(fraction: float, _user_data) -> bool:
                try:
                    progress(float(fraction))
                except Exception:  # a reporting bug must not abort the load
                    logger.exception("load progress callback failed")
                return True

            # Referenced by this frame until the load returns: llama.cpp calls it only then.
            params.struct.progress_callback = on_progress
        model = L.llama_model_load_from_file(os.fsencode(path), params.struct)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        return model

    def _new_context(self, options: RuntimeOptions):
        params = L.llama_context_default_params()
        params.n_ctx = options.ctx_size
        params.n_batch = options.n_batch
        params.n_ubatch = options.n_ubatch
        params.n_seq_max = options.lane_count
        params.kv_unified = options.kv_unified
        threads = options.threads or os.cpu_count() or 1
        params.n_threads = threads
        params.n_threads_batch = options.threads_batch or threads
        params.type_k = KV_CACHE_TYPES[options.cache_type_k]
        params.type_v = KV_CACHE_TYPES[options.cache_type_v]
        params.flash_attn_type = FLASH_ATTN_TYPES[options.flash_attn]
        params.no_perf = True
        if self._capture is not None:
            params.cb_eval = self._capture.callback
            params.cb_eval_user_data = self._capture.user_data
        ctx = L.llama_init_from_model(self._model, params)
        if not ctx:
            L.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create a context (n_ctx={options.ctx_size},"
                f" n_seq_max={params.n_seq_max})"
            )
        return ctx

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        self._lanes.close()
        self._host_states.close()
        L.llama_batch_free(self._batch)
        L.llama_free(self._ctx)
        L.llama_model_free(self._model)
        self._ctx = None

    def __enter__(self) -> LlamaRuntime:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -- facts -----------------------------------------------------------------------
    @property
    def lane_count(self) -> int:
        return self.options.lane_count

    @property
    def kv_pool_tokens(self) -> int:
        return self.n_ctx

    @property
    def max_session_tokens(self) -> int:
        return self.lane_capacity_tokens

    @property
    def max_batch_tokens(self) -> int:
        """Most tokens one iteration may hold (``runtime.n_batch``)."""
        return self.n_batch

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens per graph run (``runtime.n_ubatch``)."""
        return self.n_ubatch

    @property
    def eog_tokens(self) -> tuple[int, ...]:
        return self._eog_tokens

    @property
    def context(self):
        """The raw llama_context pointer, for prefix-cache operations on the worker thread."""
        return self._ctx

    @property
    def state_mappings(self):
        """Where saved states get their memory (kept mappings, for reuse)."""
        return self._host_states.mappings

    def active_session_count(self) -> int:
        return len(self._lanes.sessions)

    def session_token_count(self, session_id: str) -> int | None:
        lane = self._lanes.sessions.get(session_id)
        return None if lane is None else lane.token_count

    def kv_cells_used(self) -> int:
        """Cells held by active sessions (idle lanes' kept KV is the prefix cache's)."""
        return self._lanes.cells_used()

    # -- sessions --------------------------------------------------------------------
    def ensure_session_active(self, session_id: str, lane: int | None = None,
                              keep_tokens: int = 0) -> None:
        """Bind a new session to an idle lane; an active one is left as it is (see
        :meth:`~skippyd.engine.runtime.lanes.LaneTable.bind`)."""
        self._lanes.bind(session_id, lane, keep_tokens)

    def drop_session(self, session_id: str) -> None:
        """End the session and free its lane; the lane keeps its KV until it is reused.

        Unknown ids are ignored.
        """
        self._lanes.release(session_id)

    def trim_session(self, session_id: str, token_count: int) -> None:
        """Drop the session's KV from position ``token_count`` on."""
        if token_count < 0:
            raise InvalidIterationError(f"trim_session: token_count must be >= 0 (got {token_count})")
        self._lanes.remove_from(self._lanes.require(session_id), token_count)

    def align_session_to_token_count_if_ahead(
        self, session_id: str, target: int
    ) -> SessionAlignment | None:
        """Trim a session that is ahead of ``target``; never extend one."""
        lane = self._lanes.sessions.get(session_id)
        if lane is None or lane.token_count <= target:
            return None
        before = lane.token_count
        self._lanes.remove_from(lane, target)
        return SessionAlignment(before_token_count=before, after_token_count=target)

    @property
    def can_fork(self) -> bool:
        return True

    def fork_session(self, src_session_id: str, dst_session_id: str,
                     num_tokens: int | None = None) -> None:
        """Make ``dst`` hold ``src``'s first ``num_tokens`` tokens (all by default)."""
        self._lanes.fork(src_session_id, dst_session_id, num_tokens)

    # -- the prefix cache's lane operations ------------------------------------------
    @property
    def keeps_lane_kv(self) -> bool:
        return True

    @property
    def shares_kv_pool(self) -> bool:
        return self.options.kv_unified

    def session_history(self, session_id: str) -> tuple[int, ...]:
        """Token ids in the session's KV, in position order (empty if unknown)."""
        lane = self._lanes.sessions.get(session_id)
        return () if lane is None else tuple(lane.history)

    def lane_history(self, lane: int) -> tuple[int, ...]:
        """Token ids a lane's KV holds (its session's, or kept after it ended)."""
        return tuple(self._lanes.lane(lane).history)

    def lane_of(self, session_id: str) -> int | None:
        """The lane an active session is bound to, or None when it holds none."""
        lane = self._lanes.sessions.get(session_id)
        return None if lane is None else lane.seq_id

    def idle_lanes(self) -> list[int]:
        """Lanes no session is bound to, lowest first."""
        return [lane.seq_id for lane in self._lanes.idle()]

    def copy_lane_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        """Make the session hold the first ``num_tokens`` tokens of lane ``source``."""
        self._lanes.copy_prefix(source, session_id, num_tokens)

    def clear_lane(self, lane: int) -> None:
        """Forget what an idle lane kept."""
        self._lanes.clear(lane)

    def save_lane_state(self, lane: int, size: int | None = None) -> HostState:
        """Serialize a lane's KV into host memory (``size``: its :meth:`lane_state_bytes`
        when just read)."""
        return self._host_states.save(self._lanes.lane(lane).seq_id, size)

    def lane_state_bytes(self, lane: int) -> int:
        """Size of a lane's saved state, without saving it."""
        return self._host_states.size_of(self._lanes.lane(lane).seq_id)

    def load_session_state(self, session_id: str, state: HostState,
                           tokens: Sequence[int]) -> bool:
        """Replace the session's KV with a saved state holding ``tokens``; False when
        llama.cpp could not load it (the session is then empty)."""
        return self._lanes.load(self._lanes.require(session_id), state, tokens)

    # -- iterations ------------------------------------------------------------------
    def run_iteration(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        """Run every request's rows in one ``llama_decode`` (on a non-final stage, calls
        of at most :attr:`rows_per_call` rows); sample where asked.

        Raises:
            InvalidIterationError: the batch is malformed (nothing ran, nothing changed).
            LanesBusyError: more new sessions than free lanes (nothing changed).
            KvSlotUnavailableError: no KV slot; sessions are as before the call.
            DecodeFailedError: llama.cpp failed otherwise; sessions are as before the call.
        """
        if not requests:
            return IterationOutput()
        started = time.perf_counter()
        with self.watch:
            output = self._iterate(requests)
        self.timeline.compute_s += output.compute_s
        self.timeline.runtime_s += time.perf_counter() - started - output.compute_s
        return output

    @property
    def busy_s(self) -> float:
        """Seconds spent inside ``llama_decode`` since the runtime was made."""
        return self.timeline.compute_s

    def _iterate(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        starts = self._validate(requests)
        new_ids = [r.session_id for r in requests if r.session_id not in self._lanes.sessions]
        if new_ids:
            self._bind_new(requests, new_ids)
        sessions = [self._lanes.sessions[r.session_id] for r in requests]
        for session, start in zip(sessions, starts, strict=True):
            if start < session.token_count:  # replaying from an earlier position
                L.llama_memory_seq_rm(self._mem, session.seq_id, start, -1)
        layout = self._fill_batch(requests, sessions, starts)
        started = time.perf_counter()
        self._decode(requests, sessions, starts, new_ids)
        compute_s = time.perf_counter() - started
        return self._finish(requests, sessions, starts, layout, compute_s)

    def _bind_new(self, requests: Sequence[IterationRequest], new_ids: list[str]) -> None:
        """Bind the call's new sessions: each to the lane it asks for if that one is idle,
        the others to the lowest idle lanes left after those."""
        idle = {lane.seq_id for lane in self._lanes.idle()}
        if len(new_ids) > len(idle):
            raise LanesBusyError(
                f"iteration requires {len(new_ids)} new sessions but only {len(idle)}"
                " execution lanes are available"
            )
        hints = {r.session_id: r.lane for r in requests if r.lane is not None}
        later = []
        for session_id in new_ids:
            hint = hints.get(session_id)
            if hint in idle:
                idle.discard(hint)
                self.ensure_session_active(session_id, hint)
            else:
                later.append(session_id)
        for session_id in later:
            self.ensure_session_active(session_id)

    def _validate(self, requests: Sequence[IterationRequest]) -> list[int]:
        seen: set[str] = set()
        total = 0
        starts = []
        for request in requests:
            if request.session_id in seen:
                raise InvalidIterationError(
                    f"iteration contains duplicate session {request.session_id}"
                )
            seen.add(request.session_id)
            self._validate_input(request)
            total += request.num_rows
            starts.append(self._validate_positions(request))
        if total > self.n_batch:
            raise InvalidIterationError(
                f"iteration holds {total} tokens but n_batch is {self.n_batch}"
            )
        return starts

    def _validate_input(self, request: IterationRequest) -> None:
        sid = request.session_id
        if self.options.first_stage:
            if request.input_rows is not None:
                raise InvalidIterationError(f"session {sid}: a first stage takes tokens, not rows")
            if not request.token_ids:
                raise InvalidIterationError(f"session {sid}: no tokens to decode")
            bad = [t for t in request.token_ids if not 0 <= t < self.n_vocab]
            if bad:
                raise InvalidIterationError(
                    f"session {sid}: token id {bad[0]} outside the vocabulary (0..{self.n_vocab - 1})"
                )
        else:
            rows = request.input_rows
            if rows is None or rows.ndim != 2 or rows.shape[1] != self.n_embd or len(rows) == 0:
                raise InvalidIterationError(
                    f"session {sid}: a non-first stage takes float32 rows of width {self.n_embd}"
                )
            if request.num_tokens < 1:
                raise InvalidIterationError(f"session {sid}: rows for the drafts only")
            if request.token_ids and len(request.token_ids) != request.num_tokens:
                raise InvalidIterationError(f"session {sid}: token sideband length != row count")
        if request.sample_last and not self.options.final_stage:
            raise InvalidIterationError(f"session {sid}: only the final stage can sample")
        if request.draft:
            if not request.sample_last:
                raise InvalidIterationError(f"session {sid}: drafts need sample_last")
            bad = [t for t in request.draft if not 0 <= t < self.n_vocab]
            if bad:
                raise InvalidIterationError(
                    f"session {sid}: draft token id {bad[0]} outside the vocabulary")
        if request.sampling is not None:
            try:
                request.sampling.validate(self.n_vocab)
            except ValueError as exc:
                raise InvalidIterationError(f"session {sid}: {exc}") from exc

    def _validate_positions(self, request: IterationRequest) -> int:
        session = self._lanes.sessions.get(request.session_id)
        current = 0 if session is None else session.token_count
        n = request.num_tokens
        start = current
        if request.positions is not None:
            positions = list(request.positions)
            if len(positions) != n or positions != list(range(positions[0], positions[0] + n)):
                raise InvalidIterationError(
                    f"session {request.session_id}: positions must be {n} consecutive integers"
                )
            start = positions[0]
            if not 0 <= start <= current:
                raise InvalidIterationError(
                    f"session {request.session_id}: first position {start} would leave a gap"
                    f" (session holds {current} tokens)"
                )
        rows = request.num_rows
        if start + rows > self.lane_capacity_tokens:
            raise InvalidIterationError(
                f"session {request.session_id}: position {start + rows - 1} beyond its lane"
                f" ({self.lane_capacity_tokens} cells)"
            )
        return start

    def _fill_batch(self, requests, sessions, starts) -> _BatchLayout:
        """Write every row into the reusable batch, in lane order (see the module
        docstring); returns where each request's rows went."""
        batch = self._batch
        # A non-final stage marks every row an output: llama.cpp drops the others' rows
        # from the graph output it captures.
        all_outputs = self._capture is not None
        row = 0
        layout = _BatchLayout([0] * len(requests), [0] * len(requests), [0] * len(requests))
        self._padding = self._padding_lanes(sessions, sum(r.num_rows for r in requests))
        order: list[tuple[int, int | None]] = [(s.seq_id, i) for i, s in enumerate(sessions)]
        order.extend((lane.seq_id, None) for lane in self._padding)
        order.sort(key=lambda item: item[0])
        for seq_id, index in order:
            if index is None:  # a filler row: see _padding_lanes
                lane = self._lanes.lanes[seq_id]
                batch.token[row] = lane.history[-1] if lane.history else 0
                batch.pos[row] = lane.token_count
                batch.n_seq_id[row] = 1
                batch.seq_id[row][0] = seq_id
                batch.logits[row] = False
                row += 1
                continue
            request, start = requests[index], starts[index]
            n = request.num_rows
            if self.options.first_stage:
                for i, token in enumerate((*request.token_ids, *request.draft)):
                    batch.token[row + i] = token
            else:
                rows = np.ascontiguousarray(request.input_rows, dtype=np.float32)
                ctypes.memmove(
                    ctypes.addressof(batch.embd.contents) + row * self.n_embd * 4,
                    rows.ctypes.data, rows.nbytes,
                )
            outputs = all_outputs or (self.options.final_stage and _wants_prompt_logprobs(request))
            for i in range(n):
                batch.pos[row + i] = start + i
                batch.n_seq_id[row + i] = 1
                batch.seq_id[row + i][0] = seq_id
                batch.logits[row + i] = outputs
            # The last input row and every draft row are verified (sampled in turn).
            verified = len(request.draft) + 1 if request.sample_last else 0
            for i in range(n - verified, n):
                batch.logits[row + i] = True
            layout.n_outputs += n if outputs else verified
            layout.sample_rows[index] = row + n - max(verified, 1)
            layout.sample_outputs[index] = layout.n_outputs - max(verified, 1)
            layout.first_rows[index] = row
            row += n
        batch.n_tokens = row
        return layout

    def _padding_lanes(self, sessions, num_tokens: int) -> list[Lane]:
        """Lanes left out between the batch's lanes that get one throw-away row.

        llama.cpp puts rows of consecutive lanes only into one micro-batch (the module
        docstring), so a decode step of lanes 0-2 and 4-7, one lane between two
        requests, runs as two graph evaluations. A row for lane 3, one past its last
        cell and removed after the call (:meth:`_remove_padding`), joins them again and
        leaves the lane's cells as they were. One evaluation is cheaper than two when a
        hole lies among several rows; rows of two distant lanes run faster as two small
        evaluations, hence at least :data:`PAD_ROWS_PER_HOLE` rows per hole
        (``docs/performance-notes.md`` has the measurements).
        """
        # One pool splits a batch into micro-batches by rows, whatever their lanes.
        if (self._capture is not None or not self.options.first_stage or not sessions
                or self.options.kv_unified):
            return []
        used = {session.seq_id for session in sessions}
        holes = [self._lanes.lanes[seq_id] for seq_id in range(min(used), max(used) + 1)
                 if seq_id not in used]
        if (not holes or len(holes) * PAD_ROWS_PER_HOLE > len(used)
                or num_tokens + len(holes) > self.n_batch
                or any(lane.token_count >= self.lane_capacity_tokens for lane in holes)):
            return []
        return holes

    def _remove_padding(self) -> None:
        for lane in self._padding:
            L.llama_memory_seq_rm(self._mem, lane.seq_id, lane.token_count, -1)
        self._padding = []

    def set_compute_hook(self, hook: ComputeHook | None) -> bool:
        """Call ``hook`` right before each ``llama_decode`` (see :data:`~skippyd.engine.runtime.contract.ComputeHook`)."""
        if hook is not None:
            native.helpers()  # loaded now, not at the first request
        self._compute_hook = hook
        return True

    def _decode(self, requests, sessions, starts, new_ids) -> None:
        if self._capture is not None:
            self._capture.begin()
        if self.compute_progress is not None:
            self.compute_progress.reset()
        # Last: no call into llama.cpp between the hook and the decode.
        wake = self._compute_hook() if self._compute_hook is not None else ()
        try:
            ret = self._decode_rows(wake)
        finally:
            self._remove_padding()
        if self._decoded(ret):
            return
        for session, start in zip(sessions, starts, strict=True):
            L.llama_memory_seq_rm(self._mem, session.seq_id, start, -1)
        for session_id in new_ids:
            self.drop_session(session_id)
        if ret == 1:
            raise KvSlotUnavailableError(
                f"no KV slot for {self._batch.n_tokens} tokens"
                f" ({self.lane_capacity_tokens} cells per lane)"
            )
        raise DecodeFailedError(f"llama_decode failed with code {ret}")

    def _decoded(self, ret: int) -> bool:
        # A non-final stage stops the graph from its eval callback: llama.cpp reports that
        # as an abort (2) although the layers it owns all ran.
        return ret == 0 or (ret == 2 and self._capture is not None)

    def _decode_rows(self, wake: Sequence[int]) -> int:
        """``llama_decode`` the batch, in calls of at most :attr:`rows_per_call` rows
        (waking ``wake`` before the first); the first failing call's code, else 0."""
        batch, n = self._batch, self._batch.n_tokens
        ret = 0
        for first in range(0, n, self.rows_per_call):
            part = batch if n <= self.rows_per_call else _batch_rows(
                batch, first, min(self.rows_per_call, n - first), self.n_embd)
            if wake and first == 0:
                ret = wake_decode.decode_signalling(wake, self._ctx, part)
            else:
                ret = L.llama_decode(self._ctx, part)
            self.decode_calls += 1
            if not self._decoded(ret):
                return ret
        return ret

    def _finish(self, requests, sessions, starts, layout: _BatchLayout,
                compute_s: float) -> IterationOutput:
        output = IterationOutput(compute_s=compute_s)
        captured = self._captured_in_batch_order() if self._capture is not None else None
        argmax = self._greedy_argmax(requests, layout) if self.options.final_stage else {}
        for index, (request, session, start) in enumerate(zip(requests, sessions, starts, strict=True)):
            n = request.num_tokens
            session.token_count = start + n
            tokens = list(request.token_ids)
            if tokens:
                del session.history[start:]
                session.history.extend(tokens)
                if session.sampler is not None:
                    session.sampler.observe(tokens)
            row = layout.first_rows[index]
            output.output_rows.append(None if captured is None else captured[row : row + n])
            if self.options.final_stage and _wants_prompt_logprobs(request):
                output.prompt_logprobs[index] = self._prompt_logprobs(session, request, row, start)
            if request.draft:
                output.samples.append(self._verify(index, session, request, layout,
                                                   argmax.get(index)))
            elif request.sample_last:
                first = argmax.get(index)
                output.samples.append(self._sample_row(index, session, request,
                                                       layout.sample_rows[index],
                                                       None if first is None else first[0]))
        return output

    def _verify(self, index: int, session: Lane, request: IterationRequest,
                layout: _BatchLayout, argmax: list[int] | None) -> IterationSample:
        """Sample at the last input row and at each draft row in turn while the token
        sampled is the draft that follows; drop the rows after the last one kept.

        Sampling each row with the request's own chain, as plain decoding would one step
        at a time, keeps its output what it would have been: a draft is only a guess of
        which row's logits will be needed next (for a sampled request, a draft is kept
        with the probability the model gives it, and otherwise the token drawn instead
        follows, which is standard speculative sampling with a draft that is certain).
        """
        draft = list(request.draft)
        row = layout.sample_rows[index]
        samples: list[IterationSample] = []
        for i in range(len(draft) + 1):
            sample = self._sample_row(index, session, request, row + i,
                                      None if argmax is None else argmax[i])
            samples.append(sample)
            if sample.is_eog or i == len(draft) or sample.token != draft[i]:
                break
        accepted = len(samples) - 1
        kept = request.num_tokens + accepted
        start = session.token_count - request.num_tokens  # _finish counted the inputs
        if accepted < len(draft):
            L.llama_memory_seq_rm(self._mem, session.seq_id, start + kept, -1)
        session.token_count = start + kept
        session.history.extend(draft[:accepted])
        first, *followers = samples
        return dataclasses.replace(first, followers=tuple(followers), drafted=len(draft))

    def _greedy_argmax(self, requests, layout: _BatchLayout) -> dict[int, list[int]]:
        """The argmax of every row a plain-greedy request of the step samples (its last
        input row, then its draft rows), by request index, from one numpy call over
        llama.cpp's logits buffer (a decode step's outputs are usually exactly these)."""
        greedy = [index for index, request in enumerate(requests)
                  if request.sample_last and is_plain_greedy(request.sampling or _GREEDY)]
        if not greedy:
            return {}
        logits = output_logits(self._ctx, layout.n_outputs, self.n_vocab)
        spans = {index: range(layout.sample_outputs[index],
                              layout.sample_outputs[index] + len(requests[index].draft) + 1)
                 for index in greedy}
        if sum(len(span) for span in spans.values()) == layout.n_outputs:
            picked = logits.argmax(axis=1).tolist()
            return {index: [picked[out] for out in span] for index, span in spans.items()}
        return {index: logits[span.start:span.stop].argmax(axis=1).tolist()
                for index, span in spans.items()}

    def _sample_row(self, index: int, session: Lane, request: IterationRequest,
                    row: int, argmax: int | None) -> IterationSample:
        token = self._sample(session, request, row, argmax)
        config = request.sampling
        logprob = None
        if config is not None and config.logprobs is not None:
            logprob = token_logprob(row_logits(self._ctx, row, self.n_vocab), token,
                                    config.logprobs)
        return IterationSample(index, token, is_eog=token in self._eog_tokens, logprob=logprob)

    def _prompt_logprobs(self, session: Lane, request: IterationRequest, row: int,
                         start: int) -> list:
        assert request.sampling is not None and request.sampling.prompt_logprobs is not None
        entries, session.prompt_carry = prompt_row_logprobs(
            self._ctx, row, list(request.token_ids), start, self.n_vocab,
            request.sampling.prompt_logprobs, session.prompt_carry)
        return entries

    def _captured_in_batch_order(self) -> np.ndarray:
        """The captured rows, reordered from micro-batch order to batch row order."""
        assert self._capture is not None
        captured = self._capture.take()
        # One KV stream takes a batch's rows in order; recurrent state is split by
        # sequence whatever the layout.
        if self.options.lane_count == 1 or (self.options.kv_unified
                                            and self.info.recurrent_bytes() == 0):
            return captured
        n, step = self._batch.n_tokens, self.rows_per_call
        seq_ids = [self._batch.seq_id[row][0] for row in range(n)]
        order = [first + row for first in range(0, n, step)
                 for row in stream_split_order(seq_ids[first:first + step], self.n_ubatch)]
        in_batch_order = np.empty_like(captured)
        in_batch_order[order] = captured
        return in_batch_order

    def _sample(self, session: Lane, request: IterationRequest, row: int,
                argmax: int | None = None) -> int:
        config = request.sampling or _GREEDY
        sampler = session.sampler
        # NOTE: identity first: a request keeps its config object, and comparing every
        # field of two equal configs costs more than the greedy pick right after a decode.
        if sampler is None or (sampler.config is not config and sampler.config != config):
            session.reset_sampler()
            try:
                session.sampler = SamplerChain(
                    config, n_vocab=self.n_vocab, n_ctx=self.lane_capacity_tokens,
                    eog_tokens=self._eog_tokens, vocab=self._vocab,
                )
                session.sampler.replay_grammar(session.history)
            except GrammarError as exc:
                # The request was checked before it was queued; ending it beats aborting
                # every other session of the batch.
                logger.error("session %s: %s; ending its generation", request.session_id, exc)
                session.reset_sampler()
                return self._eog_tokens[0] if self._eog_tokens else 0
            session.sampler.observe(session.history)
        assert session.sampler is not None
        return session.sampler.sample(self._ctx, row, argmax)


#: Most bytes llama.cpp's output buffer may take on a non-final stage (:func:`output_window`).
OUTPUT_BUFFER_BUDGET = 32 << 20
#: Fewest rows a non-final stage's call holds, whatever the vocabulary: llama.cpp's CPU
#: flash attention runs 64 or more query rows through its tiled kernel, fewer row by row.
MIN_ROWS_PER_CALL = 64


def output_window(n_vocab: int, at_least: int = 0) -> int:
    """Rows per ``llama_decode`` on a non-final stage (and never fewer than ``at_least``).

    Such a stage marks every row an output, so that llama.cpp keeps all rows of its last
    layer for the next stage. llama.cpp sizes its output buffer by a call's outputs, a
    vocabulary of floats each, zero-fills it and copies into it although no logits are
    computed there: at n_batch 2048 and a 128k vocabulary that is 1 GiB the stage holds
    for nothing. Calls of this many rows keep it within :data:`OUTPUT_BUFFER_BUDGET`.
    On a CPU a micro-batch of this many rows is still bound by the weights' arithmetic,
    not by reading them; a GPU reads its weights at every micro-batch and wants wide ones,
    so a stage that offloads asks for at least its ``n_ubatch`` rows per call.
    """
    return max(MIN_ROWS_PER_CALL, at_least, OUTPUT_BUFFER_BUDGET // (4 * max(n_vocab, 1)))


def _batch_rows(batch: L.llama_batch, first: int, count: int, n_embd: int) -> L.llama_batch:
    """A view of ``count`` rows of ``batch`` from row ``first`` (no copy: it points into
    ``batch``'s arrays, so it is used while ``batch`` lives)."""

    def at(pointer, offset: int):
        if not pointer:
            return pointer
        size = ctypes.sizeof(pointer._type_)
        return ctypes.cast(ctypes.addressof(pointer.contents) + offset * size, type(pointer))

    view = L.llama_batch()
    view.n_tokens = count
    view.token = at(batch.token, first)
    view.embd = at(batch.embd, first * n_embd)
    view.pos = at(batch.pos, first)
    view.n_seq_id = at(batch.n_seq_id, first)
    view.seq_id = at(batch.seq_id, first)
    view.logits = at(batch.logits, first)
    return view


def _wants_prompt_logprobs(request: IterationRequest) -> bool:
    sampling = request.sampling
    return (sampling is not None and sampling.prompt_logprobs is not None
            and request.phase is RowPhase.PREFILL and bool(request.token_ids))
