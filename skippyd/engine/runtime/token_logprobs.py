"""Log-probabilities of tokens under the model, read from a batch row's logits.

Only sessions that ask pay for this: the logits are read in place (a numpy view over
llama.cpp's output buffer, no copy) and reduced to one log-sum-exp and, when
alternatives are wanted, a partial sort of the top few.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.contract import TokenLogprob

logger = logging.getLogger(__name__)


def row_logits(ctx: int, row: int, n_vocab: int) -> np.ndarray:
    """The logits of batch row ``row`` as a read-only view (valid until the next decode).

    Raises:
        ValueError: Row ``row`` has no logits (llama.cpp returned NULL).
    """
    # NOTE: a cached ctypes array type over the row's address, not np.ctypeslib.as_array,
    # which builds a new array type per call: this runs once per sampled token, right
    # after a decode has evicted the caches, where building a type is dear.
    address = ctypes.addressof(L.llama_get_logits_ith(ctx, row).contents)
    view = np.frombuffer(_logits_row_type(n_vocab).from_address(address),  # type: ignore[call-overload]  # a ctypes array is a buffer
                         dtype=np.float32)
    view.flags.writeable = False
    return view


def output_logits(ctx: int, n_outputs: int, n_vocab: int) -> np.ndarray:
    """Every output row's logits of the last decode, ``(n_outputs, n_vocab)``, as one
    read-only view (valid until the next decode).

    Row ``j`` belongs to the ``j``-th batch row that asked for logits, in batch order
    (llama.cpp puts them back in that order when they are read).
    """
    return _logits_view(ctypes.addressof(L.llama_get_logits(ctx).contents), n_outputs,
                        n_vocab)


@functools.lru_cache(maxsize=64)
def _logits_view(address: int, n_outputs: int, n_vocab: int) -> np.ndarray:
    # NOTE: cached: this runs once per step right after a decode, where building the
    # view costs more than the argmax over it. A view stays valid for as long as the
    # buffer is at that address with at least ``n_outputs`` rows, which is exactly
    # when llama.cpp returns that address for a step with that many outputs.
    flat = np.frombuffer(_logits_row_type(n_outputs * n_vocab).from_address(address),  # type: ignore[call-overload]  # a ctypes array is a buffer
                         dtype=np.float32)
    flat.flags.writeable = False
    return flat.reshape(n_outputs, n_vocab)


@functools.cache
def _logits_row_type(n_vocab: int) -> type[ctypes.Array[ctypes.c_float]]:
    return ctypes.c_float * n_vocab


def log_normalizer(logits: np.ndarray) -> float:
    """``log(sum(exp(logits)))``, computed stably."""
    peak = float(logits.max())
    return peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))


def top_logprobs(logits: np.ndarray, normalizer: float, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely tokens and their log-probabilities, most likely first."""
    if k <= 0:
        return ()
    top = np.argpartition(logits, -k)[-k:]
    top = top[np.argsort(-logits[top], kind="stable")]
    return tuple((int(t), float(logits[t]) - normalizer) for t in top)


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability in this row, plus the ``k`` most likely alternatives."""
    normalizer = log_normalizer(logits)
    return TokenLogprob(token, float(logits[token]) - normalizer,
                        top_logprobs(logits, normalizer, k))


def prompt_row_logprobs(
    ctx: int,
    first_row: int,
    tokens: list[int],
    start: int,
    n_vocab: int,
    k: int,
    carry: tuple[int, np.ndarray] | None,
) -> tuple[list[tuple[int, TokenLogprob]], tuple[int, np.ndarray]]:
    """Log-probabilities of a prefill chunk's tokens, each scored by the row before it.

    The last row predicts the next chunk's first token, so its logits are the returned
    carry; a ``carry`` from position ``start - 1`` scores this chunk's first token.

    Args:
        ctx: The llama context (right after the decode that computed the rows).
        first_row: Batch row of the chunk's first token (every row of it is an output).
        tokens: The chunk's tokens.
        start: KV position of ``tokens[0]``.
        n_vocab: Vocabulary size.
        k: Alternatives per token.
        carry: (position, logits) left by the previous chunk, or None.

    Returns:
        (position, log-probability) per scored token, and the carry for the next chunk.
    """
    entries = []
    if carry is not None and carry[0] == start - 1:
        entries.append((start, token_logprob(carry[1], tokens[0], k)))
    for i in range(len(tokens) - 1):
        logits = row_logits(ctx, first_row + i, n_vocab)
        entries.append((start + i + 1, token_logprob(logits, tokens[i + 1], k)))
    last = len(tokens) - 1
    return entries, (start + last, row_logits(ctx, first_row + last, n_vocab).copy())
