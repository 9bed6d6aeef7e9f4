"""Layer slicing of a GGUF into stage models, and the cache of slices.

A stage is an ordinary, shallower GGUF: every metadata key and every non-layer tensor of
the source, the ``blk.N.*`` tensors with ``layer_start <= N < layer_end`` renumbered from
0, and ``{arch}.block_count = layer_end - layer_start``. Stock llama.cpp loads it as is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from skippyd.model_files import scan
from skippyd.model_files.model_info import (
    LAYER_TENSOR,
    ModelFileError,
    ModelInfo,
    inspect_model,
    read_model_header,
)

logger = logging.getLogger(__name__)

#: Architectures that rescale the token embedding inside the graph: feeding them raw
#: activation rows on a non-first stage would be wrong: the graph would scale the rows
#: the stage before sent as if they were token embeddings.
EMBEDDING_SCALED_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding"})
#: Bumped whenever the slice layout or its cache key changes, so stale slices are not reused.
SLICE_FORMAT_VERSION = 2

ProgressFn = Callable[[int, int], None]
"""Called with (bytes done, bytes total) while a slice is written."""


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
    header = read_model_header(source)
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
        match = LAYER_TENSOR.match(tensor.name)
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
    """What identifies a GGUF cheaply, to key the slice cache.

    A digest of the header (every metadata key and the tensor table, which name the
    model, its shapes and quantization), plus the file's size and modification time:
    reading the header takes milliseconds where hashing a model's gigabytes of weights
    took minutes at every start. A file rewritten in place gets a new mtime, hence a
    new slice; a copy without its mtime (``cp`` without ``-p``) is sliced once more.
    """
    header = read_model_header(path)
    info = os.stat(path)
    digest = hashlib.sha256(f"{info.st_size}:{info.st_mtime_ns}:".encode())
    with open(path, "rb") as fh:
        remaining = header.data_offset
        while remaining > 0 and (chunk := fh.read(min(remaining, 1 << 20))):
            digest.update(chunk)
            remaining -= len(chunk)
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
    """Return a stage slice of ``source``, writing it once per (file identity, range)."""
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
