"""What a GGUF model is, from its metadata alone.

:func:`inspect_model` reads the header (no weights) into a :class:`ModelInfo`: the
architecture, layer and embedding sizes, vocabulary, quantization and the per-layer
recurrent state; a file that is missing or not a GGUF raises :class:`ModelFileError`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf

from skippyd.model_files import scan

logger = logging.getLogger(__name__)

#: A layer tensor's name: ``blk.{layer}.{rest}``.
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


class ModelFileError(Exception):
    """The file is missing, is not a GGUF, or cannot be sliced as asked."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What ``skippyd model inspect`` reports about a GGUF file."""

    path: str
    architecture: str
    name: str | None
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int | None
    quantization: str
    file_bytes: int
    has_chat_template: bool
    recurrent_state_bytes_per_layer: tuple[int, ...]
    """Per-layer recurrent state size for one sequence (0 for attention layers)."""
    kv_values_per_layer: tuple[int, ...] = ()
    """K and V values one token adds to the KV cache, per layer (0 for layers without
    attention); empty when the metadata does not say."""

    def kv_values_per_token(self, layer_start: int = 0, layer_end: int | None = None) -> int:
        """K and V values one token takes over ``[layer_start, layer_end)``."""
        end = self.n_layer if layer_end is None else layer_end
        return sum(self.kv_values_per_layer[layer_start:end])

    def recurrent_bytes(self, layer_start: int = 0, layer_end: int | None = None) -> int:
        """Recurrent state bytes of one sequence over ``[layer_start, layer_end)``."""
        end = self.n_layer if layer_end is None else layer_end
        return sum(self.recurrent_state_bytes_per_layer[layer_start:end])

    def to_dict(self) -> dict:
        data = asdict(self)
        data["recurrent_state_bytes_per_layer"] = list(self.recurrent_state_bytes_per_layer)
        data["recurrent_state_bytes_total"] = self.recurrent_bytes()
        return data


def read_model_header(path: str | os.PathLike) -> scan.GGUFHeader:
    """The parsed header of a GGUF file; :class:`ModelFileError` if it is not one."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {p}")
    try:
        return scan.read_header(p)
    except scan.GGUFFormatError as exc:
        raise ModelFileError(f"{p}: not a readable GGUF file ({exc})") from exc


def inspect_model(path: str | os.PathLike) -> ModelInfo:
    """Scan a GGUF's metadata (no weights are read)."""
    header = read_model_header(path)
    arch = header.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: general.architecture is missing")
    n_layer = header.get(f"{arch}.block_count")
    n_embd = header.get(f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelFileError(f"{path}: {arch}.block_count or {arch}.embedding_length missing")
    tokens = header.kv.get("tokenizer.ggml.tokens")
    n_vocab = header.get(f"{arch}.vocab_size") or (tokens.length if tokens else 0)
    return ModelInfo(
        path=str(path),
        architecture=arch,
        name=header.get("general.name"),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=int(n_vocab),
        n_ctx_train=header.get(f"{arch}.context_length"),
        quantization=_quantization_label(header),
        file_bytes=Path(path).stat().st_size,
        has_chat_template=isinstance(header.get("tokenizer.chat_template"), str),
        recurrent_state_bytes_per_layer=_recurrent_bytes_per_layer(header, arch, n_layer),
        kv_values_per_layer=_kv_values_per_layer(header, arch, n_layer, n_embd),
    )


def _per_layer(value, n_layer: int) -> list[int] | None:
    """A per-layer count given as one integer or as a short array of them."""
    if isinstance(value, int):
        return [value] * n_layer
    if isinstance(value, list) and len(value) == n_layer and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _kv_values_per_layer(header, arch: str, n_layer: int, n_embd: int) -> tuple[int, ...]:
    """K plus V values per token and layer: KV heads times the key and value widths."""
    heads = _per_layer(header.get(f"{arch}.attention.head_count"), n_layer)
    kv_heads = _per_layer(header.get(f"{arch}.attention.head_count_kv"), n_layer) or heads
    if kv_heads is None:
        return ()
    width = n_embd // max(1, max(heads or [1]))
    key = header.get(f"{arch}.attention.key_length", width)
    value = header.get(f"{arch}.attention.value_length", key)
    if not isinstance(key, int) or not isinstance(value, int):
        return ()
    return tuple(n * (key + value) for n in kv_heads)


def _quantization_label(header: scan.GGUFHeader) -> str:
    file_type = header.get("general.file_type")
    if isinstance(file_type, int):
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    # Fall back to the most common type among the layer weights.
    counts: dict[str, int] = {}
    for tensor in header.tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight"):
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "unknown"


def _recurrent_bytes_per_layer(header, arch: str, n_layer: int) -> tuple[int, ...]:
    """f32 state a sequence keeps per recurrent layer (conv + ssm, or token-shift + wkv).

    Attention-only layers keep no recurrent state: their KV lives in the cell pool.
    """
    layers_with_ssm = {
        int(m.group(1))
        for t in header.tensors
        if (m := LAYER_TENSOR.match(t.name)) and m.group(2).startswith(("ssm_", "time_mix"))
    }
    if not layers_with_ssm:
        return (0,) * n_layer
    d_conv = header.get(f"{arch}.ssm.conv_kernel", 0)
    d_inner = header.get(f"{arch}.ssm.inner_size", 0)
    d_state = header.get(f"{arch}.ssm.state_size", 0)
    n_group = header.get(f"{arch}.ssm.group_count", 0)
    if d_inner:
        per_layer = 4 * (max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
    else:  # RWKV: two token-shift rows plus the wkv state (head_size x n_embd)
        n_embd = header.get(f"{arch}.embedding_length", 0)
        head = header.get(f"{arch}.wkv.head_size", 64)
        per_layer = 4 * (2 * n_embd + head * n_embd)
    return tuple(per_layer if i in layers_with_ssm else 0 for i in range(n_layer))
