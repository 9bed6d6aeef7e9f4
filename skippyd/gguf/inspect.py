"""GGUF metadata scan and layer slicing into stage models (DESIGN.md item 2).

A stage is an ordinary, shallower GGUF: every metadata key and every non-layer tensor of
the source, the ``blk.N.*`` tensors with ``layer_start <= N < layer_end`` renumbered from
0, and ``{arch}.block_count = layer_end - layer_start``. Stock llama.cpp loads it as is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf

from skippyd.gguf import scan

logger = logging.getLogger(__name__)

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
#: Architectures that rescale the token embedding inside the graph: feeding them raw
#: activation rows on a non-first stage would be wrong (DESIGN.md item 3).
EMBEDDING_SCALED_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding"})
#: Bumped whenever the slice layout changes, so stale cached slices are not reused.
SLICE_FORMAT_VERSION = 1

ProgressFn = Callable[[int, int], None]
"""Called with (bytes done, bytes total) while a slice is written."""


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

    def recurrent_bytes(self, layer_start: int = 0, layer_end: int | None = None) -> int:
        """Recurrent state bytes of one sequence over ``[layer_start, layer_end)``."""
        end = self.n_layer if layer_end is None else layer_end
        return sum(self.recurrent_state_bytes_per_layer[layer_start:end])

    def to_dict(self) -> dict:
        data = asdict(self)
        data["recurrent_state_bytes_per_layer"] = list(self.recurrent_state_bytes_per_layer)
        data["recurrent_state_bytes_total"] = self.recurrent_bytes()
        return data


def _read(path: str | os.PathLike) -> scan.GGUFHeader:
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {p}")
    try:
        return scan.read_header(p)
    except scan.GGUFFormatError as exc:
        raise ModelFileError(f"{p}: not a readable GGUF file ({exc})") from exc


def inspect_model(path: str | os.PathLike) -> ModelInfo:
    """Scan a GGUF's metadata (no weights are read)."""
    header = _read(path)
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
    )


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
        if (m := _LAYER_TENSOR.match(t.name)) and m.group(2).startswith(("ssm_", "time_mix"))
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


def _check_range(info: ModelInfo, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= info.n_layer:
        raise ModelFileError(
            f"layer range {layer_start}:{layer_end} is not within the model's "
            f"{info.n_layer} layers (need 0 <= start < end <= {info.n_layer})"
        )
    if layer_start > 0 and info.architecture in EMBEDDING_SCALED_ARCHS:
        raise ModelFileError(
            f"architecture {info.architecture!r} rescales its input embedding inside the graph;"
            " it cannot run as a non-first stage"
        )


def slice_model(
    source: str | os.PathLike,
    layer_start: int,
    layer_end: int,
    output: str | os.PathLike,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the stage GGUF for ``[layer_start, layer_end)`` of ``source`` to ``output``.

    The file is written under a temporary name in the same directory and renamed into place
    only when complete, so a failure (disk full, interrupt) never leaves a half file.
    """
    info = inspect_model(source)
    _check_range(info, layer_start, layer_end)
    header = _read(source)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst, open(source, "rb") as src:
            _write_slice(src, dst, header, info, layer_start, layer_end, progress)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600; a slice is as public as its source
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.info("wrote stage slice %s (layers %d:%d)", out, layer_start, layer_end)
    return out


def _kept_tensors(header, layer_start: int, layer_end: int):
    for tensor in header.tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        if match is None:
            yield tensor.name, tensor
            continue
        layer = int(match.group(1))
        if layer_start <= layer < layer_end:
            yield f"blk.{layer - layer_start}.{match.group(2)}", tensor


def _slice_metadata(src, header, info: ModelInfo, layer_start: int, layer_end: int) -> list[bytes]:
    """Every key/value pair, copied verbatim unless it describes the layers."""
    block_key = f"{info.architecture}.block_count"
    pairs = []
    for item in header.kv.values():
        if item.key == block_key:
            pairs.append(scan.encode_kv(item.key, item.type, layer_end - layer_start))
        elif _is_per_layer_array(item, info.n_layer):
            pairs.append(scan.encode_kv(item.key, item.type, item.value[layer_start:layer_end]))
        else:
            src.seek(item.span[0])
            pairs.append(src.read(item.span[1] - item.span[0]))
    for key, value in (("layer_start", layer_start), ("layer_end", layer_end),
                       ("source_layers", info.n_layer)):
        pairs.append(scan.encode_kv(f"skippyd.slice.{key}", 4, value))
    return pairs


def _write_slice(src, dst, header, info, layer_start, layer_end, progress) -> None:
    pairs = _slice_metadata(src, header, info, layer_start, layer_end)
    kept = list(_kept_tensors(header, layer_start, layer_end))
    align = header.alignment
    infos, offset = [], 0
    for name, tensor in kept:
        infos.append(scan.encode_tensor_info(name, tensor.dims, tensor.type, offset))
        offset += tensor.nbytes + (-tensor.nbytes % align)
    dst.write(scan.MAGIC + struct.pack("<IQQ", header.version, len(kept), len(pairs)))
    for blob in (*pairs, *infos):
        dst.write(blob)
    dst.write(scan.padding(dst.tell(), align))
    total, done = sum(t.nbytes for _, t in kept), 0
    for _name, tensor in kept:
        src.seek(header.data_offset + tensor.offset)
        remaining = tensor.nbytes
        while remaining:
            chunk = src.read(min(remaining, 8 << 20))
            if not chunk:
                raise ModelFileError(f"{info.path}: tensor {tensor.name} is truncated")
            dst.write(chunk)
            remaining -= len(chunk)
        dst.write(scan.padding(tensor.nbytes, align))
        done += tensor.nbytes
        if progress is not None:
            progress(done, total)


def _is_per_layer_array(item: scan.KeyValue, n_layer: int) -> bool:
    """Some architectures store per-layer hyper-parameters as arrays (head counts...)."""
    return (
        item.type == scan.ARRAY
        and item.item_type not in (None, scan.STRING)
        and item.value is not None
        and item.length == n_layer
        and not item.key.startswith("tokenizer.")
    )


def file_identity(path: str | os.PathLike) -> str:
    """A digest of the file's content, used to key the slice cache."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def default_slice_cache_dir() -> Path:
    """Where slices are cached: systemd's CacheDirectory, else the XDG cache dir."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"]) / "slices"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skippyd" / "slices"


def cached_slice(
    source: str | os.PathLike,
    layer_start: int,
    layer_end: int,
    cache_dir: str | os.PathLike | None = None,
    progress: ProgressFn | None = None,
) -> Path:
    """Return a stage slice of ``source``, writing it once per (content digest, range)."""
    info = inspect_model(source)
    if layer_start == 0 and layer_end == info.n_layer:
        return Path(source)
    _check_range(info, layer_start, layer_end)
    directory = Path(cache_dir) if cache_dir is not None else default_slice_cache_dir()
    key = f"{file_identity(source)[:24]}-v{SLICE_FORMAT_VERSION}"
    out = directory / f"{Path(source).stem}.{key}.layers-{layer_start}-{layer_end}.gguf"
    if out.is_file():
        logger.info("using cached stage slice %s", out)
        return out
    return slice_model(source, layer_start, layer_end, out, progress)
