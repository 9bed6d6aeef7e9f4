"""Random-weight GGUF models of real shapes, for sizing hardware without a download.

A synthesized model has the widths, depth, head layout and vocabulary size of a real
model, so every step costs what it costs there; its weights are noise, so its text is
noise too. It takes the tokenizer and chat template of another GGUF (the embedded
model's, from the CLI): the vocabulary is padded with unused tokens up to the real
model's size, or cut down to it (keeping only the merges whose pieces survive), so the
output head has the real number of rows.

:func:`write_f16_model` streams the tensors to disk in bounded chunks, so an 8B shape
needs well under a GiB of memory here; quantizing the result is llama.cpp's job
(:mod:`skippyd.engine.runtime.quantize`). The same seed writes the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from skippyd.model_files.model_info import ModelFileError

logger = logging.getLogger(__name__)

#: Trained context written into a synthesized model unless asked otherwise.
DEFAULT_CONTEXT = 8192
#: Largest block of random values generated at once (float32 values).
CHUNK_VALUES = 1 << 23
#: Standard deviation of the random weights (norm weights are ones).
WEIGHT_SCALE = 0.02


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that decide what a llama-architecture model costs per token."""

    name: str
    like: str
    """The real model whose widths it copies."""
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rope_theta: float = 10000.0
    tied_embeddings: bool = False
    """The output head reuses ``token_embd`` (no ``output.weight``), as in the real model."""

    def __post_init__(self) -> None:
        for field in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer (got {value!r})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv "
                             f"{self.n_head_kv}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and numpy shape (rows, columns), in file order."""
        kv = self.n_head_kv * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [
            ("token_embd.weight", (self.n_vocab, self.n_embd)),
            ("output_norm.weight", (self.n_embd,)),
        ]
        if not self.tied_embeddings:
            out.append(("output.weight", (self.n_vocab, self.n_embd)))
        for i in range(self.n_layer):
            out += [
                (f"blk.{i}.attn_norm.weight", (self.n_embd,)),
                (f"blk.{i}.attn_q.weight", (self.n_embd, self.n_embd)),
                (f"blk.{i}.attn_k.weight", (kv, self.n_embd)),
                (f"blk.{i}.attn_v.weight", (kv, self.n_embd)),
                (f"blk.{i}.attn_output.weight", (self.n_embd, self.n_embd)),
                (f"blk.{i}.ffn_norm.weight", (self.n_embd,)),
                (f"blk.{i}.ffn_gate.weight", (self.n_ff, self.n_embd)),
                (f"blk.{i}.ffn_up.weight", (self.n_ff, self.n_embd)),
                (f"blk.{i}.ffn_down.weight", (self.n_embd, self.n_ff)),
            ]
        return out

    def parameter_count(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> int:
        """KV cache bytes one token takes over all layers (f16 by default)."""
        return round(2 * self.n_layer * self.n_head_kv * self.head_dim * bytes_per_value)


#: The named shapes of ``skippyd model synth --shape``.
SHAPES: dict[str, ModelShape] = {
    "0.5b": ModelShape("0.5b", "Qwen2.5-0.5B", n_embd=896, n_layer=24, n_head=14,
                       n_head_kv=2, n_ff=4864, n_vocab=151_936, rope_theta=1_000_000.0,
                       tied_embeddings=True),
    "1b": ModelShape("1b", "TinyLlama-1.1B", n_embd=2048, n_layer=22, n_head=32,
                     n_head_kv=4, n_ff=5632, n_vocab=32_000),
    "3b": ModelShape("3b", "Llama-3.2-3B", n_embd=3072, n_layer=28, n_head=24, n_head_kv=8,
                     n_ff=8192, n_vocab=128_256, rope_theta=500_000.0, tied_embeddings=True),
    "8b": ModelShape("8b", "Llama-3-8B", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8,
                     n_ff=14_336, n_vocab=128_256, rope_theta=500_000.0),
}


def shape_named(name: str, *, n_layer: int | None = None, n_vocab: int | None = None) -> ModelShape:
    """A named shape, with its depth or vocabulary size overridden if asked."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if n_layer is not None:
        shape = replace(shape, n_layer=n_layer)
    if n_vocab is not None:
        shape = replace(shape, n_vocab=n_vocab)
    return shape


@dataclass(frozen=True, slots=True)
class TokenizerMetadata:
    """The ``tokenizer.*`` metadata of a GGUF, sized to a vocabulary."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]
    """``bos``, ``eos``, ``unk``, ``pad`` (those the source has)."""
    add_bos: bool | None
    add_space_prefix: bool | None
    chat_template: str | None

    def sized(self, n_vocab: int) -> TokenizerMetadata:
        """This vocabulary padded with unused tokens to ``n_vocab``, or cut down to it."""
        have = len(self.tokens)
        if n_vocab == have:
            return self
        if n_vocab > have:
            extra = [f"<|unused_{i}|>" for i in range(n_vocab - have)]
            return replace(self, tokens=self.tokens + extra,
                           token_types=self.token_types
                           + [int(gguf.TokenType.UNUSED)] * len(extra))
        too_high = {name: tid for name, tid in self.special_ids.items() if tid >= n_vocab}
        if too_high:
            raise ValueError(f"a vocabulary of {n_vocab} tokens would drop the special tokens "
                             f"{too_high}; use a larger --vocab")
        kept = set(self.tokens[:n_vocab])
        merges = []
        for merge in self.merges:
            left, _, right = merge.partition(" ")
            if left in kept and right in kept and left + right in kept:
                merges.append(merge)
        return replace(self, tokens=self.tokens[:n_vocab],
                       token_types=self.token_types[:n_vocab], merges=merges)


def read_tokenizer(path: str | Path) -> TokenizerMetadata:
    """The tokenizer and chat template of the GGUF at ``path``."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot read the tokenizer: {exc}") from exc

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    tokens = value("tokenizer.ggml.tokens")
    model = value("tokenizer.ggml.model")
    if not tokens or not model:
        raise ModelFileError(f"{path}: has no tokenizer.ggml.tokens / tokenizer.ggml.model")
    types = value("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
    special = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
        found = value(f"tokenizer.ggml.{key}")
        if found is not None:
            special[name] = int(found)
    return TokenizerMetadata(
        model=str(model), pre=value("tokenizer.ggml.pre"), tokens=list(tokens),
        token_types=[int(t) for t in types], merges=list(value("tokenizer.ggml.merges") or []),
        special_ids=special, add_bos=value("tokenizer.ggml.add_bos_token"),
        add_space_prefix=value("tokenizer.ggml.add_space_prefix"),
        chat_template=value("tokenizer.chat_template"),
    )


def _random_rows(shape: tuple[int, ...], seed: int, index: int) -> Iterator[np.ndarray]:
    """A tensor's f16 values in blocks of whole rows; the same seed gives the same values."""
    rng = np.random.default_rng([seed, index])
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        block *= WEIGHT_SCALE
        yield block.astype(np.float16)


def write_f16_model(shape: ModelShape, output: str | Path, tokenizer: TokenizerMetadata, *,
                    n_ctx: int = DEFAULT_CONTEXT, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Write ``shape`` with random f16 weights (f32 norms of ones) to ``output``.

    Args:
        shape: Sizes of the model.
        output: File to write (replaced if it exists).
        tokenizer: Its tokenizer; sized to ``shape.n_vocab`` here.
        n_ctx: Trained context written into the metadata.
        seed: Seeds the weights.
        progress: Called with (bytes written, total bytes) as tensors are written.
    """
    if n_ctx < 1:
        raise ValueError(f"n_ctx must be positive (got {n_ctx})")
    tokenizer = tokenizer.sized(shape.n_vocab)
    output = Path(output)
    writer = gguf.GGUFWriter(str(output), "llama")
    writer.add_name(f"skippyd synthetic {shape.name} ({shape.like} shape, random weights)")
    writer.add_description(f"random weights in the shape of {shape.like}; seed {seed}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model(tokenizer.model)
    if tokenizer.pre:
        writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    if tokenizer.merges:
        writer.add_token_merges(tokenizer.merges)
    for name, tid in tokenizer.special_ids.items():
        {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
         "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}[name](tid)
    if tokenizer.add_bos is not None:
        writer.add_add_bos_token(bool(tokenizer.add_bos))
    if tokenizer.add_space_prefix is not None:
        writer.add_add_space_prefix(bool(tokenizer.add_space_prefix))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    tensors = shape.tensors()
    sizes = []
    for name, dims in tensors:
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        nbytes = int(np.prod(dims)) * dtype.itemsize
        writer.add_tensor_info(name, dims, dtype, nbytes)
        sizes.append(nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    align = writer.data_alignment
    total, done = sum(sizes), 0
    with open(output, "ab") as out:
        out.write(b"\0" * (-out.tell() % align))
        for index, ((_name, dims), nbytes) in enumerate(zip(tensors, sizes, strict=True)):
            if len(dims) == 1:
                out.write(np.ones(dims, dtype=np.float32).tobytes())
            else:
                for block in _random_rows(dims, seed, index):
                    out.write(block.tobytes())
            out.write(b"\0" * (-nbytes % align))
            done += nbytes
            if progress is not None:
                progress(done, total)
    return output
