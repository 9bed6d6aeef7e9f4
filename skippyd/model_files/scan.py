"""A fast, raw GGUF header reader and copier.

``gguf.GGUFReader`` builds a numpy view for every element of every array, which takes
seconds on a tokenizer with 100 000 entries. Inspecting and slicing only need the scalar
metadata, the byte span of each key/value pair (to copy it verbatim) and the tensor
table, so this module reads the header with ``struct`` directly (GGUF v2/v3 layout).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from math import prod
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct formats for the fixed-size ones.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
#: Arrays longer than this keep only their length (tokenizer tables are 100k long).
MAX_KEPT_ARRAY = 4096


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands."""


class _TruncatedError(GGUFFormatError):
    """The header runs past the bytes read so far (read more, or the file is cut)."""


@dataclass(slots=True)
class KeyValue:
    key: str
    type: int
    value: object
    """Scalar, str, list (short arrays) or None (long arrays; see ``length``)."""
    span: tuple[int, int]
    """Byte range of the whole pair in the file, for verbatim copies."""
    length: int = 0
    """Element count for arrays."""
    item_type: int | None = None


@dataclass(slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    type: int
    offset: int
    """Relative to the start of the data section."""

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type)]
        return prod(self.dims) // block * type_size

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type).name


@dataclass(slots=True)
class GGUFHeader:
    version: int
    kv: dict[str, KeyValue] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    alignment: int = DEFAULT_ALIGNMENT

    def get(self, key: str, default=None):
        item = self.kv.get(key)
        return default if item is None or item.value is None else item.value


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str):
        try:
            value = struct.unpack_from(fmt, self.data, self.pos)[0]
        except struct.error as exc:
            raise _TruncatedError(f"truncated header at byte {self.pos}") from exc
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise _TruncatedError(f"string of {n} bytes runs past the end at byte {self.pos}")
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")  # read first: `self.pos += self.unpack()` would lose 8 bytes
        self.pos += n

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise GGUFFormatError(f"unknown value type {vtype} at byte {self.pos}")
        return self.unpack(fmt)


#: Bytes read first; most headers fit, a large tokenizer table takes a few more reads.
_FIRST_READ_BYTES = 1 << 20


def read_header(path) -> GGUFHeader:
    """Parse the header of a GGUF file (metadata and tensor table, no weights).

    Reads 1 MiB, and four times more while the header runs past what was read, so a
    model's weights are never read just to look at its metadata.
    """
    size = _FIRST_READ_BYTES
    with open(path, "rb") as fh:
        while True:
            fh.seek(0)
            data = fh.read(size)
            try:
                return _parse_header(memoryview(data))
            except _TruncatedError:
                if len(data) < size:  # the file itself ends inside its header
                    raise
            size *= 4


def _parse_header(data: memoryview) -> GGUFHeader:
    if len(data) < 24 or bytes(data[:4]) != MAGIC:
        raise GGUFFormatError("missing GGUF magic")
    cur = _Cursor(data)
    cur.pos = 4
    header = GGUFHeader(version=cur.unpack("<I"))
    if header.version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {header.version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    for _ in range(n_kv):
        item = _read_kv(cur)
        header.kv[item.key] = item
    header.alignment = int(header.get("general.alignment", DEFAULT_ALIGNMENT))
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        header.tensors.append(TensorInfo(name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    if cur.pos > len(data):  # a skipped array or string ran past the end
        raise _TruncatedError(f"truncated header at byte {len(data)}")
    header.data_offset = _align(cur.pos, header.alignment)
    return header


def _read_kv(cur: _Cursor) -> KeyValue:
    start = cur.pos
    key = cur.string()
    vtype = cur.unpack("<I")
    if vtype != ARRAY:
        value = cur.value(vtype)
        return KeyValue(key, vtype, value, (start, cur.pos))
    item_type, count = cur.unpack("<I"), cur.unpack("<Q")
    keep = count <= MAX_KEPT_ARRAY
    values: list[Any] | None = [] if keep else None
    if item_type == STRING:
        for _ in range(count):
            if values is not None:
                values.append(cur.string())
            else:
                cur.skip_string()
    else:
        fmt = _SCALAR.get(item_type)
        if fmt is None:
            raise GGUFFormatError(f"{key}: unknown array item type {item_type}")
        size = struct.calcsize(fmt)
        if keep:
            if cur.pos + size * count > len(cur.data):
                raise _TruncatedError(f"{key}: array runs past the end at byte {cur.pos}")
            raw = cur.data[cur.pos : cur.pos + size * count]
            values = [v[0] for v in struct.iter_unpack(fmt, raw)]
        cur.pos += size * count
    return KeyValue(key, ARRAY, values, (start, cur.pos), length=count, item_type=item_type)


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def encode_kv(key: str, vtype: int, value) -> bytes:
    """Serialise one key/value pair (scalars, strings, arrays of scalars)."""
    out = bytearray(_encode_str(key))
    out += struct.pack("<I", vtype)
    if vtype == ARRAY:
        item_type = _array_item_type(value)
        out += struct.pack("<IQ", item_type, len(value))
        for item in value:
            out += _encode_value(item_type, item)
    else:
        out += _encode_value(vtype, value)
    return bytes(out)


def _array_item_type(values) -> int:
    if values and isinstance(values[0], float):
        return 6
    return 5 if values and min(values) < 0 else 4


def _encode_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        return _encode_str(value)
    return struct.pack(_SCALAR[vtype], value)


def _encode_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def encode_tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return (_encode_str(name) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset))


def padding(offset: int, alignment: int) -> bytes:
    return b"\0" * (-offset % alignment)
