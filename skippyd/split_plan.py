"""``skippyd config split``: a model's layers cut into balanced stages, one config each.

A layer costs, per token, about what reading and multiplying its weight matrices costs,
so the bytes of its tensors measure its work; ``token_embd`` is a lookup (free), and the
output head costs its matrix, on the final stage. The layers are cut into contiguous
ranges that keep the most loaded stage as light as possible (a pipeline runs at its
slowest stage's pace), within each host's memory when it is given. Each stage gets a
config of its own: its layer range, its link (listening on its host, distinct ports when
hosts repeat), its neighbours, one fresh secret shared by all, stage 0's HTTP listener,
and with ``tls`` the pipeline's keys (:mod:`skippyd.link.keys`). Timed work instead of
bytes comes from :mod:`skippyd.split_measure`.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from skippyd.config.schema import CACHE_TYPE_BYTES
from skippyd.model_files import scan
from skippyd.model_files.model_info import ModelInfo, inspect_model

#: First link port; stage ``i`` listens on ``LINK_PORT + i``.
LINK_PORT = 9101
#: Stage 0's HTTP port.
HTTP_PORT = 8080
_LAYER = re.compile(r"^blk\.(\d+)\.")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class SplitError(ValueError):
    """The model cannot be split as asked (named in the message)."""


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What each part of a model weighs, in bytes of its tensors."""

    layers: tuple[int, ...]
    """Bytes of each layer's tensors."""
    embedding: int
    """``token_embd``: held by the first stage (a lookup: no compute)."""
    head: int
    """The output head (``output`` and ``output_norm``, or the tied embedding): the
    final stage computes it."""


def model_costs(path: str | Path) -> ModelCosts:
    """Per-layer, embedding and head bytes of the GGUF at ``path``.

    Raises:
        ModelFileError: The file cannot be read.
    """
    header = scan.read_header(path)
    info = inspect_model(path)
    layers = [0] * info.n_layer
    embedding = head = 0
    tied = True
    for tensor in header.tensors:
        match = _LAYER.match(tensor.name)
        if match:
            layers[int(match.group(1))] += tensor.nbytes
        elif tensor.name.startswith("token_embd"):
            embedding += tensor.nbytes
        elif tensor.name.startswith("output"):
            head += tensor.nbytes
            tied = tied and not tensor.name.startswith("output.")
    if tied:  # the head multiplies by the embedding matrix itself
        head += embedding
    return ModelCosts(tuple(layers), embedding, head)


def parse_size(text: str) -> int:
    """``16G``, ``512M``, ``8GiB`` or plain bytes as a byte count.

    Raises:
        ValueError: Not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 16G, 512M)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True, slots=True)
class Work:
    """What each layer and the output head cost, in one unit, for balancing the cut."""

    layers: tuple[float, ...]
    head: float
    unit: str
    """``"bytes"`` (weights multiplied per token) or ``"ms"`` (timed per decode step)."""


def weight_work(costs: ModelCosts) -> Work:
    """Work as the bytes of weights each part multiplies per token."""
    return Work(tuple(float(size) for size in costs.layers), float(costs.head), "bytes")


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int
    layer_start: int
    layer_end: int
    host: str
    compute_bytes: int
    """Weight bytes this stage multiplies per token (its layers, and the head if final)."""
    memory_bytes: int
    """Its weights and its KV cache at the planned context."""
    work: float
    """Its share of the :class:`Work` the cut balanced, in that work's unit."""


def plan_split(costs: ModelCosts, stages: int, *, work: Work | None = None,
               kv_bytes_per_layer: int = 0, memory: Sequence[int] | None = None,
               hosts: Sequence[str] | None = None) -> list[StagePlan]:
    """Cut the layers into ``stages`` contiguous ranges, the most loaded as light as
    possible, each within its ``memory`` (bytes, per stage) when given.

    Args:
        costs: The model's weights (:func:`model_costs`).
        stages: How many stages.
        work: What each layer and the head cost (default: their weight bytes,
            :func:`weight_work`); timed work comes from :mod:`skippyd.split_measure`.
        kv_bytes_per_layer: KV cache bytes one layer takes at the planned context.
        memory: Each stage's memory; None: no limit.
        hosts: Each stage's host (default: all on 127.0.0.1).

    Raises:
        SplitError: Fewer layers than stages, lists of the wrong length, or no cut that
            fits the memory given.
    """
    layers = costs.layers
    n = len(layers)
    work = work if work is not None else weight_work(costs)
    if len(work.layers) != n:
        raise SplitError(f"work given for {len(work.layers)} layers; the model has {n}")
    if not 1 <= stages <= n:
        raise SplitError(f"--stages: between 1 and the model's {n} layers (got {stages})")
    for name, values in (("--memory", memory), ("--hosts", hosts)):
        if values is not None and len(values) != stages:
            raise SplitError(f"{name}: one value per stage ({stages}), got {len(values)}")
    prefix = [0]
    for size in layers:
        prefix.append(prefix[-1] + size)
    work_prefix = [0.0]
    for cost in work.layers:
        work_prefix.append(work_prefix[-1] + cost)

    def compute(stage: int, start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (costs.head if stage == stages - 1 else 0)

    def load_of(stage: int, start: int, end: int) -> float:
        return work_prefix[end] - work_prefix[start] + (work.head if stage == stages - 1
                                                        else 0.0)

    def weighs(stage: int, start: int, end: int) -> int:
        extra = (costs.embedding if stage == 0 else 0) + (
            costs.head if stage == stages - 1 else 0)
        return prefix[end] - prefix[start] + extra + kv_bytes_per_layer * (end - start)

    def fits(stage: int, start: int, end: int) -> bool:
        return memory is None or weighs(stage, start, end) <= memory[stage]

    # best[s][j]: the lightest possible heaviest stage when stages 0..s-1 hold layers 0..j-1.
    infinite = math.inf
    best = [[infinite] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == infinite or not fits(s - 1, i, j):
                    continue
                load = max(best[s - 1][i], load_of(s - 1, i, j))
                if load < best[s][j]:
                    best[s][j], cut[s][j] = load, i
    if best[stages][n] == infinite:
        raise SplitError("no cut of the layers fits the --memory given: add memory or stages")
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    where = list(hosts) if hosts is not None else ["127.0.0.1"] * stages
    return [StagePlan(s, bounds[s], bounds[s + 1], where[s],
                      compute(s, bounds[s], bounds[s + 1]),
                      weighs(s, bounds[s], bounds[s + 1]),
                      load_of(s, bounds[s], bounds[s + 1])) for s in range(stages)]


@dataclass(frozen=True, slots=True)
class SplitConfig:
    """One stage's config file, ready to write."""

    plan: StagePlan
    path: Path
    text: str


def kv_bytes_per_layer(info: ModelInfo, ctx_size: int, cache_type: str = "f16") -> int:
    """KV cache bytes one (average) layer takes for ``ctx_size`` tokens."""
    values = info.kv_values_per_token() / max(1, info.n_layer)
    return int(values * ctx_size * CACHE_TYPE_BYTES[cache_type])


def render_configs(model: Path, plans: list[StagePlan], directory: Path, *, ctx_size: int,
                   lane_count: int, tls_paths: dict[int, tuple[str, str, str]] | None = None,
                   secret: str | None = None) -> list[SplitConfig]:
    """The config of every stage of ``plans`` (nothing is written).

    Args:
        model: The whole model (each stage slices its range at start).
        plans: :func:`plan_split`'s stages.
        directory: Where the configs will be.
        ctx_size, lane_count: The same on every stage (each holds every session; each
            lane's KV stream gets ``ctx_size / lane_count`` cells).
        tls_paths: Per stage index, its (CA, certificate, key) paths relative to
            ``directory``, for ``link.tls``.
        secret: The shared link secret (a fresh random one if None).
    """
    secret = secret or secrets.token_hex(32)
    last = len(plans) - 1
    remote = any(plan.host not in ("127.0.0.1", "localhost") for plan in plans)
    out = []
    for plan in plans:
        port = LINK_PORT + plan.index
        lines = [
            f"# Stage {plan.index} of {len(plans)}: layers {plan.layer_start}-"
            f"{plan.layer_end - 1} of {model.name}"
            + (f", on {plan.host}" if remote else "") + ".",
            f"# Written by `skippyd config split`; {plan.compute_bytes / 2**20:.0f} MiB of "
            f"weights to multiply per token, about {plan.memory_bytes / 2**30:.2f} GiB "
            "with its KV cache.",
            "",
            "[stage]",
            f'id = "stage-{plan.index}"',
            f"index = {plan.index}",
            f'model_path = "{model}"',
            f"layer_start = {plan.layer_start}",
            f"layer_end = {plan.layer_end}",
            "",
            "[runtime]",
            f"ctx_size = {ctx_size}",
            f"lane_count = {lane_count}",
            "",
        ]
        if plan.index == 0:
            lines += ["[http]",
                      f'listen = "{"0.0.0.0" if remote else "127.0.0.1"}:{HTTP_PORT}"', ""]
        lines += ["[link]", f'listen = "{"0.0.0.0" if remote else "127.0.0.1"}:{port}"']
        if remote:
            lines.append(f'advertise = "tcp://{plan.host}:{port}"')
        lines.append("# Every stage of the pipeline shares this secret; keep it private.")
        lines.append(f'secret = "{secret}"')
        if tls_paths is not None:
            ca, cert, key = tls_paths[plan.index]
            lines += ["tls = true", f'tls_ca = "{ca}"', f'tls_cert = "{cert}"',
                      f'tls_key = "{key}"']
        lines.append("")
        if plan.index > 0:
            before = plans[plan.index - 1]
            lines += ["[upstream]", f'stage_id = "stage-{before.index}"',
                      f"stage_index = {before.index}",
                      f'endpoint = "tcp://{before.host}:{LINK_PORT + before.index}"', ""]
        if plan.index < last:
            after = plans[plan.index + 1]
            lines += ["[downstream]", f'stage_id = "stage-{after.index}"',
                      f"stage_index = {after.index}",
                      f'endpoint = "tcp://{after.host}:{LINK_PORT + after.index}"', ""]
        out.append(SplitConfig(plan, directory / f"stage-{plan.index}.toml",
                               "\n".join(lines)))
    return out
