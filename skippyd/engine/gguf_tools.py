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
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf

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


def open_reader(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF for reading, turning every failure into :class:`ModelFileError`."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {p}")
    try:
        return gguf.GGUFReader(str(p), "r")
    except Exception as exc:  # gguf raises ValueError, struct errors, IndexError...
        raise ModelFileError(f"{p}: not a readable GGUF file ({exc})") from exc


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:
        return default


def inspect_model(path: str | os.PathLike) -> ModelInfo:
    """Scan a GGUF's metadata (no weights are read)."""
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: general.architecture is missing")
    n_layer = _field(reader, f"{arch}.block_count")
    n_embd = _field(reader, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelFileError(f"{path}: {arch}.block_count or {arch}.embedding_length missing")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)
    return ModelInfo(
        path=str(path),
        architecture=arch,
        name=_field(reader, "general.name"),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=int(n_vocab),
        n_ctx_train=_field(reader, f"{arch}.context_length"),
        quantization=_quantization_label(reader),
        file_bytes=Path(path).stat().st_size,
        has_chat_template=isinstance(_field(reader, "tokenizer.chat_template"), str),
        recurrent_state_bytes_per_layer=_recurrent_bytes_per_layer(reader, arch, n_layer),
    )


def _quantization_label(reader: gguf.GGUFReader) -> str:
    file_type = _field(reader, "general.file_type")
    if isinstance(file_type, int):
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    # Fall back to the most common type among the layer weights.
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight"):
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "unknown"


def _recurrent_bytes_per_layer(reader: gguf.GGUFReader, arch: str, n_layer: int) -> tuple[int, ...]:
    """f32 state a sequence keeps per recurrent layer (conv + ssm, or token-shift + wkv).

    Attention-only layers keep no recurrent state: their KV lives in the cell pool.
    """
    layers_with_ssm = {
        int(m.group(1))
        for t in reader.tensors
        if (m := _LAYER_TENSOR.match(t.name)) and m.group(2).startswith(("ssm_", "time_mix"))
    }
    if not layers_with_ssm:
        return (0,) * n_layer
    d_conv = _field(reader, f"{arch}.ssm.conv_kernel", 0) or 0
    d_inner = _field(reader, f"{arch}.ssm.inner_size", 0) or 0
    d_state = _field(reader, f"{arch}.ssm.state_size", 0) or 0
    n_group = _field(reader, f"{arch}.ssm.group_count", 0) or 0
    if d_inner:
        per_layer = 4 * (max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner)
    else:  # RWKV: two token-shift rows plus the wkv state (head_size x n_embd)
        n_embd = _field(reader, f"{arch}.embedding_length", 0) or 0
        head = _field(reader, f"{arch}.wkv.head_size", 64) or 64
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
    reader = open_reader(source)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    try:
        _write_slice(reader, info, layer_start, layer_end, tmp_name, progress)
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.info("wrote stage slice %s (layers %d:%d)", out, layer_start, layer_end)
    return out


def _kept_tensors(reader: gguf.GGUFReader, layer_start: int, layer_end: int):
    for tensor in reader.tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        if match is None:
            yield tensor.name, tensor
            continue
        layer = int(match.group(1))
        if layer_start <= layer < layer_end:
            yield f"blk.{layer - layer_start}.{match.group(2)}", tensor


def _write_slice(reader, info: ModelInfo, layer_start, layer_end, path, progress) -> None:
    arch = info.architecture
    writer = gguf.GGUFWriter(path, arch, endianess=reader.endianess)
    block_key = f"{arch}.block_count"
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == block_key:
            value = layer_end - layer_start
        elif _is_per_layer_array(field, info.n_layer):
            value = value[layer_start:layer_end]
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    writer.add_key_value("skippyd.slice.layer_start", layer_start, gguf.GGUFValueType.UINT32)
    writer.add_key_value("skippyd.slice.layer_end", layer_end, gguf.GGUFValueType.UINT32)
    writer.add_key_value("skippyd.slice.source_layers", info.n_layer, gguf.GGUFValueType.UINT32)
    kept = list(_kept_tensors(reader, layer_start, layer_end))
    total = sum(int(t.n_bytes) for _, t in kept)
    for name, tensor in kept:
        writer.add_tensor_info(
            name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for _name, tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
        done += int(tensor.n_bytes)
        if progress is not None:
            progress(done, total)
    writer.close()


def _is_per_layer_array(field, n_layer: int) -> bool:
    """Some architectures store per-layer hyper-parameters as arrays (head counts...)."""
    return (
        field.types[0] == gguf.GGUFValueType.ARRAY
        and len(field.types) == 2
        and field.types[1] != gguf.GGUFValueType.STRING
        and len(field.data) == n_layer
        and not field.name.startswith("tokenizer.")
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
