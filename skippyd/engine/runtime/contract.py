"""The contract between the worker and a runtime.

The worker (:mod:`skippyd.engine.worker`) and the prefix cache drive one object that
satisfies :class:`Runtime`: ``llama.LlamaRuntime`` over one llama.cpp context, or stage
0's ``pipeline.PipelineRuntime`` over a split pipeline; tests may use a scripted fake.
Everything that crosses this boundary is a plain dataclass defined here, so the worker
never imports llama.cpp.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from skippyd.engine.runtime.watch import CallWatch

#: llama.cpp's hard cap on sequence ids per context (``LLAMA_MAX_SEQ``).
LLAMA_MAX_SEQ = 256
#: Native limit on logit-bias entries per sampler.
MAX_LOGIT_BIAS = 256
#: Most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` cap).
MAX_TOP_LOGPROBS = 20


class RowPhase(enum.Enum):
    """What a request row in a batch is doing."""

    PREFILL = "prefill"
    DECODE = "decode"


class RuntimeFailure(Exception):
    """Base of every error a runtime raises on purpose."""


class LanesBusyError(RuntimeFailure):
    """No execution lane is free for a new session."""


class InvalidIterationError(RuntimeFailure, ValueError):
    """A batch request is malformed; nothing was executed and no state changed."""


class UnavailableError(RuntimeFailure):
    """A part of the runtime that lives elsewhere (a downstream pipeline stage) cannot be
    reached right now; nothing local changed and retrying later may succeed."""


class KvSlotUnavailableError(RuntimeFailure):
    """llama_decode found no KV slot for the batch (return code 1): back-pressure.

    The batch was not applied; sessions are exactly as before the call, so the caller may
    free memory (evict cache entries, preempt a sequence) and retry.
    """


class DecodeFailedError(RuntimeFailure):
    """llama_decode failed for a reason other than KV exhaustion."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Per-session sampling parameters.

    ``temperature <= 0`` means greedy. Penalties look at the last ``penalty_last_n``
    tokens of the session (prompt included); ``-1`` means the whole context.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    """None draws a fresh seed per session."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, additive bias) pairs; at most :data:`MAX_LOGIT_BIAS`."""
    ignore_eos: bool = False
    """When set, end-of-generation tokens are masked out and never sampled."""
    grammar: str | None = None
    """GBNF grammar (start rule ``root``) every generated token must fit; None: free text."""
    grammar_start: int = 0
    """KV position where the constrained output begins (the prompt's length). A sampler
    rebuilt mid-generation (after a trim or a preemption) replays the session's tokens
    from here on into its grammar."""
    logprobs: int | None = None
    """Report each sampled token's log-probability and this many most likely alternatives;
    None reports nothing."""
    prompt_logprobs: int | None = None
    """Report the log-probability of every prompt token after the first (and this many
    alternatives); the prompt's rows then become outputs. None reports nothing."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self, n_vocab: int | None = None, n_ctx: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field.

        ``n_ctx`` caps ``penalty_last_n`` (its history buffer is sized by it).
        """
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature: must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (got {self.top_k})")
        for name in ("top_p", "min_p", "typical_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be within [0, 1] (got {value})")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty: must be > 0 (got {self.repeat_penalty})")
        if self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n: must be >= -1 (got {self.penalty_last_n})")
        if n_ctx is not None and self.penalty_last_n > n_ctx:
            raise ValueError(f"penalty_last_n: must be at most the context size {n_ctx} "
                             f"(got {self.penalty_last_n})")
        if not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k: must be within [0, 2^31) (got {self.top_k})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias: at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})"
            )
        self._validate_extensions()
        if n_vocab is not None:
            for token_id, _bias in self.logit_bias:
                if not 0 <= token_id < n_vocab:
                    raise ValueError(
                        f"logit_bias: token id {token_id} outside the vocabulary (0..{n_vocab - 1})"
                    )


    def _validate_extensions(self) -> None:
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar: must be a non-empty string")
        if self.grammar_start < 0:
            raise ValueError(f"grammar_start: must be >= 0 (got {self.grammar_start})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name}: must be within [0, {MAX_TOP_LOGPROBS}] (got {value})")


GREEDY = SamplingConfig(temperature=0.0)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model, with the most likely alternatives.

    Log-probabilities are those of the model's raw distribution (log-softmax of the
    logits), before temperature, penalties, biases and grammar.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the most likely tokens, most likely first."""


@dataclass(slots=True)
class IterationRequest:
    """One session's rows in a batched iteration.

    Exactly one of ``token_ids`` (first stage) and ``input_rows`` (non-first stage,
    float32 of shape ``(n_tokens, n_embd)``, token-major) carries the input.
    """

    session_id: str
    token_ids: Sequence[int] = ()
    input_rows: np.ndarray | None = None
    positions: Sequence[int] | None = None
    """Explicit positions, one per token; None continues the session."""
    sampling: SamplingConfig | None = None
    """None means greedy when sampling is needed."""
    sample_last: bool = False
    """Sample a token from the logits of the last row (final stages only)."""
    phase: RowPhase = RowPhase.PREFILL
    draft: Sequence[int] = ()
    """Tokens guessed to follow the input (speculative decoding), computed as extra rows
    after it and verified in order: each is kept while it is what the request's own
    sampling picks at the row before it; the first that is not, and every row after it,
    leaves the session's KV. Needs ``sample_last``. With row input (a split pipeline's
    final stage) ``input_rows`` holds the draft rows too, after the input's."""
    lane: int | None = None
    """The lane to bind a new session to if that lane is idle (a later stage of a split
    keeps a session where stage 0 does: llama.cpp evaluates rows of consecutive lanes
    together); ignored for a session already bound, and when the lane is taken."""

    @property
    def num_tokens(self) -> int:
        """Rows of input, drafts not included."""
        if self.input_rows is not None:
            return int(self.input_rows.shape[0]) - len(self.draft)
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        """Rows this request puts in the batch: its input and its drafts."""
        return self.num_tokens + len(self.draft)


@dataclass(frozen=True, slots=True)
class IterationSample:
    """A token sampled for the request at ``request_index`` of the batch."""

    request_index: int
    token: int
    is_eog: bool
    """The token ends generation (EOS/EOT per the model's vocabulary)."""
    logprob: TokenLogprob | None = None
    """The sampled token's log-probability, when the request's sampling asks for it."""
    followers: tuple[IterationSample, ...] = ()
    """Tokens sampled after this one at the rows of the drafts it confirmed, in order:
    one per accepted draft (the last may differ from its draft: it is the correction, or
    the token after a fully accepted draft). Generation goes on from the last of them."""
    drafted: int = 0
    """Drafts this row verified (accepted or not); ``len(followers)`` were accepted."""

    @property
    def tokens(self) -> tuple[IterationSample, ...]:
        """This sample and its followers, in order."""
        return (self, *self.followers)


@dataclass(slots=True)
class IterationOutput:
    """Result of one batched call."""

    output_rows: list[np.ndarray | None] = field(default_factory=list)
    """Per request, in order: captured activation rows (non-final stage) or None."""
    samples: list[IterationSample] = field(default_factory=list)
    """One entry per request with ``sample_last``, in request order."""
    compute_s: float = 0.0
    """Wall time spent inside llama.cpp for this call."""
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    """Per request index asking for them: (KV position, log-probability) of the tokens
    this call's rows predicted, for ``prompt_logprobs`` sessions."""


@dataclass(frozen=True, slots=True)
class SessionAlignment:
    before_token_count: int
    after_token_count: int


class SavedState(Protocol):
    """A lane's KV saved in host memory (:meth:`Runtime.save_lane_state`)."""

    def __len__(self) -> int:
        """Its size in bytes."""
        ...

    def release(self) -> None:
        """Free its memory now; idempotent."""
        ...


@runtime_checkable
class Runtime(Protocol):
    """What the worker drives: sessions in lanes over one KV pool, one batched call at a time.

    A session is a named sequence of KV cells (a llama.cpp sequence id while it holds a
    lane). Only the worker thread calls a runtime once the worker owns it. A method that
    fails on purpose raises a :class:`RuntimeFailure` subclass and, unless it says
    otherwise, leaves every session as it was.
    """

    @property
    def lane_count(self) -> int:
        """Sessions that may be active at once."""

    @property
    def kv_pool_tokens(self) -> int:
        """Cells of the KV pool every session shares."""

    @property
    def max_batch_tokens(self) -> int:
        """Most tokens one :meth:`run_iteration` call may carry (``n_batch``)."""

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens the model computes per graph run (``n_ubatch``): a prompt chunk of at
        most this many tokens runs the graph once, and a stage that sends activations on
        ships them per micro-batch."""

    @property
    def max_session_tokens(self) -> int:
        """Most tokens one session can hold (prompt plus generated): its lane's KV."""

    def active_session_count(self) -> int:
        """Sessions that hold a lane now."""

    def kv_cells_used(self) -> int:
        """KV cells the active sessions hold (cells shared by several count once per
        session, so this is an upper bound)."""

    def session_token_count(self, session_id: str) -> int | None:
        """Tokens in the session's KV, or None when the session is not active."""

    def ensure_session_active(self, session_id: str, lane: int | None = None,
                              keep_tokens: int = 0) -> None:
        """Give the session a lane unless it already has one.

        Args:
            session_id: The session.
            lane: The idle lane to take (the prefix cache's choice); by default the
                runtime picks one.
            keep_tokens: Leading tokens of what that lane holds the session starts with
                (a prefix restored in place); the rest of the lane is cleared.

        Raises:
            LanesBusyError: Every lane is taken.
            InvalidIterationError: ``lane`` is not idle or holds fewer tokens.
        """

    def run_iteration(self, requests: Sequence[IterationRequest]) -> IterationOutput:
        """Run every request's rows in one batched model call, then sample.

        Each request's rows go into its session at its explicit positions (the first at
        most the session's token count; what it held from there on is replaced), or after
        what it holds when positions are None; a new session gets a lane.

        Returns:
            One output per request, in order (captured activation rows on a stage that
            sends them on), and one sample per request with ``sample_last``.

        Raises:
            InvalidIterationError: A malformed request (unknown token, a gap in positions,
                a duplicate session), named; no session changed.
            LanesBusyError: More new sessions than free lanes; no session changed.
            KvSlotUnavailableError: No room in the KV pool (retry later); no session changed.
            UnavailableError: The rest of a pipeline is unreachable; the batch's sessions
                are lost.
            DecodeFailedError: The model call failed otherwise; the batch's sessions are lost.
        """

    def align_session_to_token_count_if_ahead(
        self, session_id: str, target: int
    ) -> SessionAlignment | None:
        """Trim a session that holds more than ``target`` tokens; never extend one.

        Returns:
            The token counts before and after, or None when nothing was trimmed.
        """

    def trim_session(self, session_id: str, token_count: int) -> None:
        """Drop the session's KV from position ``token_count`` on.

        Raises:
            InvalidIterationError: The session is not active.
        """

    def drop_session(self, session_id: str) -> None:
        """Free the session's lane and cells; a session that is not active is ignored."""

    def close(self) -> None:
        """Free everything the runtime holds; idempotent. No call may follow."""

    # -- watching ----------------------------------------------------------------------
    watch: CallWatch
    """Marked by every batched call; the daemon reads it to tell a hung call from a
    long one. Assign one to watch the runtime."""

    def set_compute_hook(self, hook: ComputeHook | None) -> bool:
        """Call ``hook`` right before each model computation (see :data:`ComputeHook`);
        False when this runtime cannot, and the caller runs it before each call."""

    # -- choices: n > 1 ----------------------------------------------------------------
    @property
    def can_fork(self) -> bool:
        """Whether :meth:`fork_session` copies sessions here."""

    def fork_session(self, src_session_id: str, dst_session_id: str,
                     num_tokens: int | None = None) -> None:
        """Make ``dst`` (taking a lane if new) hold ``src``'s first ``num_tokens`` tokens.

        ``None`` copies all of them. The source is unchanged.

        Raises:
            InvalidIterationError: ``src`` is unknown or holds fewer tokens, or the
                runtime cannot fork (:attr:`can_fork` is False).
            LanesBusyError: ``dst`` is new and no lane is free.
        """

    # -- the prefix cache's lane operations (only where keeps_lane_kv) -----------------
    @property
    def keeps_lane_kv(self) -> bool:
        """Whether a lane keeps its KV after its session ends, for the prefix cache to
        reuse; without it the lane operations below raise InvalidIterationError."""

    @property
    def shares_kv_pool(self) -> bool:
        """Whether every lane draws on one pool of cells, so KV an idle lane keeps takes
        room an active session may need (:meth:`clear_lane` gives it back)."""

    def session_history(self, session_id: str) -> tuple[int, ...]:
        """Token ids in the session's KV, in position order (empty if unknown)."""

    def lane_history(self, lane: int) -> tuple[int, ...]:
        """Token ids a lane's KV holds (its session's, or kept after it ended)."""

    def lane_of(self, session_id: str) -> int | None:
        """The lane an active session is bound to, or None when it holds none."""

    def idle_lanes(self) -> list[int]:
        """Lanes no session is bound to, lowest first."""

    def clear_lane(self, lane: int) -> None:
        """Drop what an idle lane kept.

        Raises:
            InvalidIterationError: The lane is not idle.
        """

    def copy_lane_prefix(self, source: int, session_id: str, num_tokens: int) -> None:
        """Make the session hold the first ``num_tokens`` tokens of lane ``source`` (its
        lane's own KV is replaced).

        Raises:
            InvalidIterationError: Unknown session or lane, or a count the lane lacks.
            DecodeFailedError: The state could not be copied.
        """

    def save_lane_state(self, lane: int, size: int | None = None) -> SavedState:
        """The lane's KV saved in host memory. ``size`` is the lane's
        :meth:`lane_state_bytes` when just read.

        Raises:
            DecodeFailedError: The state could not be saved.
        """

    def lane_state_bytes(self, lane: int) -> int:
        """Size of a lane's saved state, without saving it."""

    def load_session_state(self, session_id: str, state: Any,
                           tokens: Sequence[int]) -> bool:
        """Replace the session's KV with a saved state holding ``tokens``; False when it
        could not be loaded (the session is then empty)."""


ComputeHook = Callable[[], Sequence[int]]
"""Run right before a model computation; returns the eventfds to signal as it starts.

The hook runs on the calling thread after every other call into llama.cpp of the
iteration, so nothing between the hook and the computation releases the GIL. The
runtime signals the eventfds once the GIL is released for the computation
(``wake_decode``), so a woken thread runs while llama.cpp computes and finds the GIL
free, not in the middle of the caller's Python."""
