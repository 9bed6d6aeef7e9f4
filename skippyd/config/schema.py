"""The stage config tree: frozen dataclasses whose fields carry their validation rules.

Each TOML section is one dataclass and each key one field, with the same name. A field's
``metadata`` holds its range (``lo``/``hi``) and an optional ``check`` that normalises
the value or raises ``ValueError``; choices are ``Literal`` types. The loader reads
these rules, so adding a key means adding a field here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

from skippyd.config.defaults import (
    available_cpus,
    default_model_path,
    default_socket_path,
    model_id_for,
)

logger = logging.getLogger(__name__)

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
FlashAttn = Literal["auto", "enabled", "disabled"]
TelemetryLevel = Literal["summary", "debug"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "text", "json"]
KvCacheMode = Literal["disabled", "auto", "record", "lookup-record"]
KvCachePayload = Literal["auto", "resident-kv", "kv-recurrent", "full-state"]
ReasoningFormat = Literal["auto", "none"]
ActivationDtype = Literal["f32", "f16"]
HttpProtocol = Literal["h11", "httptools", "auto"]
KvLayout = Literal["unified", "per_lane"]
SpeculativeMode = Literal["off", "ngram", "draft"]

#: ``ggml_type`` ids of the KV cache element types (llama.cpp ``GGML_TYPE_*``).
GGML_TYPE_IDS: dict[str, int] = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
    "iq4_nl": 20, "bf16": 30,
}
#: Bytes per cached value of each KV cache type (quantized types store blocks of 32).
CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
}
#: llama.cpp ``LLAMA_FLASH_ATTN_TYPE_*`` values.
FLASH_ATTN_TYPE_IDS: dict[str, int] = {"auto": -1, "disabled": 0, "enabled": 1}
#: :mod:`logging` levels of ``telemetry.log_level``.
LOG_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG, "info": logging.INFO,
    "warning": logging.WARNING, "error": logging.ERROR,
}
#: KV cache types that need no flash attention when used for V.
UNQUANTIZED_CACHE_TYPES = frozenset({"f32", "f16", "bf16"})
# NOTE: llama.cpp caps sequence ids at 256 (LLAMA_MAX_SEQ) and the prefix cache needs
# ids beyond the lanes, hence at most 255 lanes.
MAX_LANES = 255
#: ``sun_path`` holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
MIN_SECRET_CHARS = 16
#: llama.cpp's ``llama_max_devices()``: the most devices a tensor split may name.
MAX_GPU_DEVICES = 16
MIB = 1 << 20
#: ``stage.id`` when the config does not set one.
DEFAULT_STAGE_ID = "stage-0"
_STAGE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def show_value(value: Any) -> str:
    """Render a config value for an error message, TOML-style."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool | int | float | str):
        text = json.dumps(value)
        return text if len(text) <= 80 else text[:76] + '..."'
    return str(value)


def parse_host_port(text: str) -> tuple[str, int]:
    """Split ``"host:port"`` (IPv6 as ``"[::1]:port"``) into host and port.

    Raises:
        ValueError: ``text`` is not of that form or the port is out of range.
    """
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"expected host:port, IPv6 hosts in brackets (got {show_value(text)})")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"expected host:port (got {show_value(text)})")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port must be at most 65535 (got {port})")
    return host, port


def _check_listen(value: str) -> str:
    parse_host_port(value)
    return value


def _check_endpoint(value: str) -> str:
    scheme, sep, rest = value.partition("://")
    if sep and scheme != "tcp":
        raise ValueError(f'unsupported scheme "{scheme}" (expected host:port or tcp://host:port)')
    address = rest if sep else value
    if parse_host_port(address)[1] == 0:
        raise ValueError("port must be between 1 and 65535 (got 0)")
    return address


def _check_stage_id(value: str) -> str:
    if not _STAGE_ID_RE.fullmatch(value):
        raise ValueError(
            'must be 1-64 letters, digits, ".", "_" or "-", starting with a letter or digit'
            f" (got {show_value(value)})"
        )
    return value


def validate_stage_id(value: str) -> str:
    """``value`` if it may be a ``stage.id``; else ``ValueError`` saying what may be."""
    return _check_stage_id(value)


def _check_non_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty (leave the key out instead)")
    return value


def parse_tensor_split(value: str) -> tuple[float, ...]:
    """``"3,1"`` as proportions ``(3.0, 1.0)``; raises ``ValueError`` naming the problem."""
    parts = [part.strip() for part in value.split(",")]
    try:
        shares = tuple(float(part) for part in parts)
    except ValueError:
        raise ValueError(f"expected comma-separated numbers such as \"3,1\" (got {value!r})"
                         ) from None
    if any(not share >= 0 or share == float("inf") for share in shares):
        raise ValueError(f"every share must be a finite number >= 0 (got {value!r})")
    if not any(shares):
        raise ValueError(f"at least one share must be above 0 (got {value!r})")
    if len(shares) > MAX_GPU_DEVICES:
        raise ValueError(f"at most {MAX_GPU_DEVICES} devices (got {len(shares)})")
    return shares


def _check_tensor_split(value: str) -> str:
    return ",".join(f"{share:g}" for share in parse_tensor_split(value))


def _check_secret(value: str) -> str:
    # NOTE: never echo the secret itself in a message.
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"must be at least {MIN_SECRET_CHARS} characters (got {len(value)})")
    return value


def _setting(
    default: Any = MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    check: Callable[[Any], Any] | None = None,
    factory: Any = MISSING,
    derived: bool = False,
) -> Any:
    """A dataclass field with its validation rules in ``metadata``.

    ``check`` returns the (possibly normalised) value or raises ``ValueError``.
    ``derived`` marks a field without a static default whose value parsing computes
    when the key is absent; any other field without a default is required.
    """
    meta = {"lo": lo, "hi": hi, "check": check, "derived": derived}
    return field(default=default, default_factory=factory, metadata=meta)


@dataclass(frozen=True, slots=True)
class StageSection:
    """``[stage]``: the model this process serves and the layers ``[start, end)`` it owns."""

    id: str = _setting(DEFAULT_STAGE_ID, check=_check_stage_id)
    """Stage name; names the default control socket and appears in telemetry."""
    index: int = _setting(0, lo=0)
    """Position in the pipeline; stage 0 takes tokens and serves HTTP."""
    model_id: str = _setting(model_id_for(None), check=_check_non_empty)
    """Served model id; defaults to the model file name without ``.gguf``."""
    model_path: str | None = _setting(None, check=_check_non_empty)
    """GGUF file; ``None`` means the embedded SmolLM2-135M model."""
    layer_start: int = _setting(0, lo=0)
    """First owned layer."""
    layer_end: int | None = _setting(None, lo=1)
    """One past the last owned layer; ``None`` means the model's last layer."""

    @property
    def is_first(self) -> bool:
        """Whether this stage takes tokens (rather than activations) as input."""
        return self.index == 0 and self.layer_start == 0

    @property
    def num_layers(self) -> int | None:
        """Owned layer count, or ``None`` until the range is resolved."""
        return None if self.layer_end is None else self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True)
class RuntimeSection:
    """``[runtime]``: the llama.cpp context and the iteration scheduler."""

    ctx_size: int | None = _setting(None, lo=16, hi=1 << 24)
    """KV cells of all lanes together (llama-server's ``-c``). ``None``: the model's
    trained context for every request (per lane, or for the one pool), capped so the KV
    cache takes at most half of the memory available at start beside the model (the
    start-up log says what was chosen and why)."""
    kv_layout: KvLayout = "per_lane"
    """``per_lane``: each lane has a stream of its own of ``ctx_size / lane_count`` cells
    (llama-server's ``--no-kv-unified``): a request's attention spans only its own
    tokens. ``unified``: the lanes share one pool of ``ctx_size`` cells, so one request
    may use all of it while the others use little, in less memory; requests are admitted
    by the cells they need, and when the pool runs out the youngest is preempted and
    recomputed later; every row's attention spans the pool's used cells, so each token
    costs more CPU, the more so with long prompts beside (``docs/scheduler.md``, *KV
    memory*, has the figures)."""
    lane_count: int = _setting(4, lo=1, hi=MAX_LANES)
    """Concurrent sequences (llama.cpp sequence ids)."""
    n_batch: int = _setting(2048, lo=1, hi=1 << 16)
    """Most tokens in one ``llama_decode`` call."""
    n_ubatch: int = _setting(512, lo=1, hi=1 << 16)
    """Micro-batch size; at most ``n_batch``."""
    threads: int = _setting(factory=available_cpus, lo=1, hi=1024)
    """Threads for decoding; defaults to the CPUs available to the process."""
    threads_batch: int = _setting(factory=available_cpus, lo=1, hi=1024)
    """Threads for prompt processing; defaults to ``threads``."""
    cache_type_k: CacheType = "f16"
    """Element type of the K cache."""
    cache_type_v: CacheType = "f16"
    """Element type of the V cache; quantized types need flash attention."""
    flash_attn: FlashAttn = "auto"
    """Flash attention: let llama.cpp decide, force it on, or off."""
    gpu_layers: int = _setting(0, lo=-1, hi=1 << 20)
    """Layers of this stage's model offloaded to the GPU (llama.cpp's ``n_gpu_layers``,
    llama-server's ``-ngl``); -1 offloads all of them and the output head. Needs a
    llama-cpp-python built with a GPU backend (CUDA, Metal, Vulkan, ROCm); on a CPU-only
    build the model stays on the CPU and the start-up log says so."""
    main_gpu: int = _setting(0, lo=0, hi=MAX_GPU_DEVICES - 1)
    """The GPU that holds the model when it is not split across GPUs (``--main-gpu``)."""
    tensor_split: str | None = _setting(None, check=_check_tensor_split)
    """How to share the offloaded layers between GPUs, as proportions: ``"3,1"`` puts
    three quarters on the first GPU (``--tensor-split``); ``None``: by free memory."""
    safe_mode: bool = False
    """Serialise every sequence (one per decode): a debugging fallback; also turned on
    by ``SKIPPYD_SAFE_MODE``."""
    continuous_batching: bool = True
    """Admit new sequences into running batches."""
    target_step_ms: float = _setting(250.0, lo=0.0, hi=60_000.0)
    """While requests are decoding, prompts are prefilled in chunks sized so that one
    iteration (their decode rows plus the chunk) takes about this long: running streams
    keep getting a token every step instead of freezing for a whole prompt. Smaller
    values smooth streams more and delay long prompts' first token. A chunk is at least
    65 tokens (below 64, llama.cpp's CPU attention to the prompt's cached part takes a
    slower kernel; ``docs/scheduler.md``, *Planning an iteration*, has the figures) when
    such a step is estimated within twice this.
    While long prompts queue up or prompts arrive in a burst, a step may take up to 4
    times this, so the queue cannot grow without end; 0 prefills prompts whole, between
    decode steps."""
    target_decode_steps: float = _setting(4.0, lo=0.0, hi=1000.0)
    """The step time prompt chunks are sized for is at least this many times the
    estimated step of the decode rows alone: on a model whose decode rows already take
    most of ``target_step_ms`` (a 1B model on a few CPU cores), a fixed target leaves
    room for prompt chunks too small to run at full speed. 0: ``target_step_ms`` alone."""
    pipeline_decode_groups: int | None = _setting(None, lo=1, hi=MAX_LANES)
    """Groups a split pipeline cuts each iteration's decode rows into, so every stage
    works on one while the next computes another, in equal groups; ``None``: stage 0
    times a decode step of 1 to 8 rows when it starts and sizes the groups by those
    costs, at most one per stage plus one (the one travelling). Prompt tokens go in
    batches of about 64 whatever it says. Also set by ``SKIPPYD_PIPELINE_DECODE_GROUPS``."""
    queue_capacity: int = _setting(64, lo=1, hi=1 << 20)
    """Generations that may wait for a lane; beyond it requests are refused."""
    admission_timeout_s: float = _setting(60.0, lo=0.0, hi=86_400.0)
    """A generation still waiting for a lane after this many seconds ends with an error
    (HTTP 503 with ``Retry-After``, or an error event on a stream); 0 waits forever."""
    stall_timeout_s: float = _setting(120.0, lo=0.0, hi=86_400.0)
    """A generation holding a lane that makes no progress (no prompt chunk computed, no
    token) for this many seconds ends with an error; 0 never gives up."""
    slice_cache_dir: str | None = _setting(None, check=_check_non_empty)
    """Where sliced stage models are cached; ``None`` means the default cache dir."""

    @property
    def session_tokens(self) -> int | None:
        """Most tokens one request may hold (None until ``ctx_size`` is resolved)."""
        if self.ctx_size is None:
            return None
        return self.ctx_size if self.kv_layout == "unified" else self.ctx_size // self.lane_count

    @property
    def ggml_type_k(self) -> int:
        """``cache_type_k`` as a llama.cpp ``ggml_type`` id."""
        return GGML_TYPE_IDS[self.cache_type_k]

    @property
    def ggml_type_v(self) -> int:
        """``cache_type_v`` as a llama.cpp ``ggml_type`` id."""
        return GGML_TYPE_IDS[self.cache_type_v]

    @property
    def flash_attn_type(self) -> int:
        """``flash_attn`` as a llama.cpp ``llama_flash_attn_type`` value."""
        return FLASH_ATTN_TYPE_IDS[self.flash_attn]


@dataclass(frozen=True, slots=True)
class HttpSection:
    """``[http]``: the OpenAI-compatible API (first stage only) and its limits."""

    listen: str = _setting("127.0.0.1:8080", check=_check_listen)
    """``host:port`` to serve on; port 0 picks a free port."""
    api_key: str | None = _setting(None, check=_check_non_empty)
    """Bearer token clients must send; ``None`` disables authentication."""
    model_alias: str | None = _setting(None, check=_check_non_empty)
    """Model name the API reports instead of ``stage.model_id``."""
    default_max_tokens: int | None = _setting(None, lo=1)
    """``max_tokens`` of requests that give none; ``None`` generates until the end of
    generation or a full context, so a request without a limit gets a whole answer."""
    max_body_bytes: int = _setting(MIB, lo=1024, hi=1 << 30)
    """Largest request body accepted."""
    max_prompt_tokens: int | None = _setting(None, lo=1)
    """Longest prompt accepted; ``None``: as many tokens as one request may hold (the
    whole pool with the unified layout, a lane's share with ``per_lane``)."""
    max_tokens_limit: int = _setting(4096, lo=1)
    """Largest ``max_tokens`` a request may ask for."""
    max_stop_strings: int = _setting(4, lo=0, hi=64)
    """Most stop strings per request."""
    max_stop_length: int = _setting(256, lo=1, hi=65536)
    """Longest stop string, in characters."""
    max_logit_bias: int = _setting(256, lo=0, hi=256)
    """Most logit-bias entries per request (llama.cpp allows 256)."""
    max_connections: int = _setting(256, lo=1, hi=65536)
    """Requests in flight at once (``/health`` aside); beyond it requests get 429."""
    max_open_connections: int = _setting(1024, lo=1, hi=1 << 20)
    """Open TCP connections; beyond it the one idle longest is closed for the newcomer."""
    header_timeout_s: float = _setting(60.0, lo=0.1, hi=3600.0)
    """A new connection must send a whole request head within this time."""
    body_timeout_s: float = _setting(60.0, lo=0.1, hi=3600.0)
    """A request body must arrive whole within this time of its head."""
    keep_alive_timeout_s: float = _setting(75.0, lo=0.1, hi=3600.0)
    """An idle keep-alive connection is closed after this long without a request head."""
    send_timeout_s: float = _setting(60.0, lo=0.1, hi=3600.0)
    """A client that reads nothing of its response for this long is disconnected."""
    protocol: HttpProtocol = "httptools"
    """uvicorn's HTTP/1.1 implementation: ``httptools`` (C parser, a dependency), ``h11``
    (pure Python, slower per streamed chunk) or ``auto``."""
    parse_special_in_content: bool = False
    """Let message text spell the chat template's control tokens (unsafe: prompt injection)."""
    drain_timeout_s: float = _setting(30.0, lo=0.0, hi=3600.0)
    """How long shutdown waits for running requests."""
    max_choices: int = _setting(16, lo=1, hi=256)
    """Largest ``n`` (choices per request)."""
    chat_template_file: str | None = _setting(None, check=_check_non_empty)
    """A Jinja chat template to use instead of the model's own."""
    reasoning_format: ReasoningFormat = "auto"
    """``auto`` returns a thinking model's ``<think>`` text as ``reasoning_content``;
    ``none`` leaves it in ``content``."""

    @property
    def address(self) -> tuple[str, int]:
        """``listen`` split into host and port."""
        return parse_host_port(self.listen)


@dataclass(frozen=True, slots=True)
class SamplingSection:
    """``[sampling]``: what the API samples with when a request leaves a field out.

    The defaults are llama-server's.
    """

    temperature: float = _setting(0.8, lo=0.0, hi=100.0)
    """Softmax temperature; 0 is greedy."""
    top_k: int = _setting(40, lo=0)
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = _setting(0.95, lo=0.0, hi=1.0)
    """Nucleus sampling: keep the most likely tokens up to this probability mass."""
    min_p: float = _setting(0.05, lo=0.0, hi=1.0)
    """Drop tokens less likely than this fraction of the most likely one."""
    repeat_penalty: float = _setting(1.0, lo=0.01, hi=100.0)
    """Penalty on recently seen tokens; 1 is none."""


@dataclass(frozen=True, slots=True)
class ControlSection:
    """``[control]``: the local Unix socket that feeds ``skippyd top``."""

    socket: str = _setting(
        factory=lambda: str(default_socket_path(DEFAULT_STAGE_ID)), check=_check_non_empty
    )
    """Socket path; defaults to :func:`default_socket_path` of ``stage.id``."""
    group: str | None = _setting(None, check=_check_non_empty)
    """Group granted access (mode 0660); ``None`` keeps the socket owner-only."""

    @property
    def socket_path(self) -> Path:
        """``socket`` as a path."""
        return Path(self.socket)


@dataclass(frozen=True, slots=True)
class TelemetrySection:
    """``[telemetry]``: event detail, logs and the Prometheus listener."""

    level: TelemetryLevel = "summary"
    """``debug`` adds per-iteration events."""
    log_level: LogLevel = "info"
    """Threshold of the ``skippyd`` loggers."""
    log_format: LogFormat = "auto"
    """``auto``: journal priorities under systemd, colour on a terminal, else plain text;
    ``text``: always plain text; ``json``: one JSON object per line."""
    log_requests: bool = True
    """Log one ``info`` line per finished request (tokens, queue time, TTFT, tok/s)."""
    stats_interval_s: float = _setting(10.0, lo=0.0, hi=3600.0)
    """Seconds between throughput lines while the stage is busy; 0 turns them off."""
    metrics_listen: str | None = _setting(None, check=_check_listen)
    """``host:port`` of a listener serving only ``/metrics`` and ``/health`` (no API key):
    the way to scrape a later stage of a split pipeline, which has no HTTP API."""

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``metrics_listen`` split into host and port, or ``None``."""
        return None if self.metrics_listen is None else parse_host_port(self.metrics_listen)

    @property
    def log_level_number(self) -> int:
        """``log_level`` as a :mod:`logging` level."""
        return LOG_LEVELS[self.log_level]


@dataclass(frozen=True, slots=True)
class KvCacheSection:
    """``[kv_cache]``: the prefix cache."""

    mode: KvCacheMode = "auto"
    """``disabled``, ``auto``, ``record`` only, or ``lookup-record``."""
    payload: KvCachePayload = "auto"
    """What an entry holds: resident KV, KV plus recurrent state, or the full state."""
    max_entries: int = _setting(64, lo=0)
    """Most cached prefixes, in idle lanes and in host RAM together; 0 disables the cache."""
    host_ram_bytes: int = _setting(256 * MIB, lo=0)
    """Budget of the host-RAM tier: saved states plus their token index; 0 disables it."""
    min_tokens: int = _setting(64, lo=1)
    """Shortest prefix worth caching."""
    shared_prefix_stride_tokens: int = _setting(128, lo=1)
    """Spacing of the shared-prefix record points."""
    shared_prefix_record_limit: int = _setting(2, lo=0)
    """Most shared-prefix records made per request."""

    @property
    def enabled(self) -> bool:
        """Whether the prefix cache runs at all."""
        return self.mode != "disabled"


@dataclass(frozen=True, slots=True)
class SpeculativeSection:
    """``[speculative]``: drafted tokens verified as extra rows of each decode step."""

    mode: SpeculativeMode = "off"
    """``off``; ``ngram``: drafts from the request's own prompt and output; ``draft``: a
    small draft model (``draft_model_path``) with the target's vocabulary. Each request
    drafts only while its acceptance makes the rows worth their cost here. Off by
    default: a drafted row is computed in a batch of another shape, which moves the last
    bits of the logits, so a greedy answer can differ from the same request's answer
    without drafts where two tokens are nearly tied."""
    draft_model_path: str | None = _setting(None, check=_check_non_empty)
    """The draft model of ``mode = "draft"`` (GGUF, same vocabulary as the model)."""
    min_draft: int = _setting(2, lo=1, hi=64)
    """Fewest drafts a decode row carries when it carries any."""
    max_draft: int = _setting(16, lo=1, hi=64)
    """Most drafts a decode row carries."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True, slots=True)
class LinkSection:
    """``[link]``: the stage-to-stage TCP link of split serving."""

    listen: str | None = _setting(None, check=_check_listen)
    """``host:port`` to accept stage connections on; required on every later stage."""
    secret: str | None = _setting(None, check=_check_secret)
    """Secret shared by the pipeline's stages; required when a peer is set."""
    status_secret: str | None = _setting(None, check=_check_secret)
    """A read-only credential: it opens STATUS connections (monitoring), nothing else."""
    max_chains: int = _setting(1, lo=1, hi=64)
    """Upstream chains a later stage serves at once; a second stage 0 is refused."""
    max_frame_bytes: int = _setting(64 * MIB, lo=4096, hi=(1 << 32) - 1)
    """Largest frame accepted from a peer."""
    connect_timeout_s: float = _setting(30.0, lo=1.0, hi=3600.0)
    """How long one attempt to connect to the next stage may take, handshake included;
    stage 0 then tries again with backoff."""
    silence_timeout_s: float = _setting(3.0, lo=2.0, hi=600.0)
    """A stage connection on which nothing arrived for this long is taken for lost, as
    if it had closed: the peer stopped, or its machine or network is gone. Peers PING
    every second; raise it only for links that can hold seconds of traffic queued."""
    advertise: str | None = _setting(None, check=_check_endpoint)
    """Final stage: the ``host:port`` stage 0 dials for predictions (default: ``listen``;
    set it when stage 0 reaches this stage through a NAT, a port forward or a proxy)."""
    activation_dtype: ActivationDtype = "f32"
    """Stage 0: how activation rows cross the links: ``f32`` (exact) or ``f16`` (half
    the bytes; greedy output may differ from the unsplit model's)."""
    tls: bool = False
    """Run every stage connection inside TLS 1.3, both ends presenting a certificate of
    the pipeline's CA (``skippyd link keygen`` makes them); the same on every stage."""
    tls_ca: str | None = _setting(None, check=_check_non_empty)
    """The pipeline CA's certificate (PEM): the only issuer a peer's certificate may have."""
    tls_cert: str | None = _setting(None, check=_check_non_empty)
    """This stage's certificate (PEM), naming ``stage.id`` as its common name."""
    tls_key: str | None = _setting(None, check=_check_non_empty)
    """The key of ``tls_cert`` (PEM, unencrypted; keep it mode 0600)."""

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``listen`` split into host and port, or ``None``."""
        return None if self.listen is None else parse_host_port(self.listen)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """``[upstream]`` / ``[downstream]``: a neighbouring stage."""

    stage_id: str = _setting(check=_check_stage_id)
    """The peer's ``stage.id``."""
    stage_index: int = _setting(lo=0, derived=True)
    """The peer's ``stage.index``; defaults to this stage's index - 1 / + 1."""
    endpoint: str = _setting(check=_check_endpoint)
    """The peer's link address, ``host:port`` (a ``tcp://`` prefix is stripped)."""

    @property
    def address(self) -> tuple[str, int]:
        """``endpoint`` split into host and port."""
        return parse_host_port(self.endpoint)


@dataclass(frozen=True, slots=True)
class StageConfig:
    """The whole configuration of one stage process; build it with the loader."""

    stage: StageSection = field(default_factory=StageSection)
    """``[stage]``."""
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    """``[runtime]``."""
    http: HttpSection | None = field(default_factory=HttpSection)
    """``[http]``; ``None`` on every stage but the first."""
    sampling: SamplingSection = field(default_factory=SamplingSection)
    """``[sampling]``."""
    control: ControlSection = field(default_factory=ControlSection)
    """``[control]``."""
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    """``[telemetry]``."""
    kv_cache: KvCacheSection = field(default_factory=KvCacheSection)
    """``[kv_cache]``."""
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    """``[speculative]``."""
    link: LinkSection = field(default_factory=LinkSection)
    """``[link]``."""
    upstream: PeerConfig | None = None
    """The previous stage; ``None`` on the first stage."""
    downstream: PeerConfig | None = None
    """The next stage; ``None`` on the final stage."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The input as written, before defaults; ``apply_overrides`` starts from it."""

    @property
    def is_first(self) -> bool:
        """Whether this stage takes tokens and serves HTTP."""
        return self.stage.is_first

    @property
    def is_final(self) -> bool:
        """Whether this stage produces logits (it has no downstream)."""
        return self.downstream is None

    @property
    def planned_decode_groups(self) -> int | None:
        """Decode groups this stage plans for, unless ``pipeline_decode_groups`` says.

        Stage 0 of a split learns the chain's length at the handshake (``None`` here); a
        later stage must coalesce at most one group: the final stage knows the length
        (index + 1), a middle one assumes one stage after it. A whole model has one group.
        """
        if self.runtime.pipeline_decode_groups is not None:
            return self.runtime.pipeline_decode_groups
        if self.is_first:
            return 1 if self.is_final else None
        return self.stage.index + (1 if self.is_final else 2)

    @property
    def resolved_model_path(self) -> Path:
        """``stage.model_path``, or the embedded model (may raise ``ConfigError``)."""
        if self.stage.model_path is not None:
            return Path(self.stage.model_path)
        return default_model_path()

    @property
    def served_model_id(self) -> str:
        """The model name the API reports: ``http.model_alias`` or ``stage.model_id``."""
        alias = self.http.model_alias if self.http is not None else None
        return alias or self.stage.model_id


#: TOML section name -> dataclass, in file order.
SECTIONS: dict[str, type] = {
    "stage": StageSection, "runtime": RuntimeSection, "http": HttpSection,
    "sampling": SamplingSection, "control": ControlSection, "telemetry": TelemetrySection, "kv_cache": KvCacheSection,
    "speculative": SpeculativeSection, "link": LinkSection, "upstream": PeerConfig, "downstream": PeerConfig,
}
