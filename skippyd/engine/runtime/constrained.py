"""Grammar-constrained sampling over llama.cpp's grammar sampler (worker thread only).

Checking every candidate against the grammar costs milliseconds over a vocabulary of tens
of thousands of tokens, far more than the rest of the sampler chain. So a constrained
session samples *without* the grammar first and asks the grammar only about that token:
most tokens of a structured answer are the model's own first choice. A refused token is
drawn again from the grammar-filtered candidates (:func:`_resample`). Every token sampled
is accepted by the grammar and the chains. The HTTP side only parses a grammar once, with
:func:`check_grammar`, on a vocabulary of its own.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.token_logprobs import row_logits

logger = logging.getLogger(__name__)

#: ``llama_token_data`` laid out as numpy sees it (int32 id, float logit, float p).
TOKEN_DATA_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
#: Candidates filtered first, per token the choosing samplers can keep (at least 64).
_NARROW_FACTOR = 4
_NARROW_MIN = 64


class GrammarError(ValueError):
    """A grammar llama.cpp cannot parse, or a token sequence it does not accept."""


def check_grammar(vocab: int, text: str) -> None:
    """Parse ``text`` as a GBNF grammar with start rule ``root``; raise if llama.cpp cannot.

    Args:
        vocab: A ``llama_vocab`` pointer (any model load with the same vocabulary).
        text: The grammar.

    Raises:
        GrammarError: llama.cpp rejected the grammar (syntax, missing ``root``, left
            recursion, undefined rule).
    """
    sampler = L.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("llama.cpp could not parse the grammar (syntax error, no 'root' "
                           "rule, an undefined rule or left recursion)")
    L.llama_sampler_free(sampler)


class Candidates:
    """One row's logits as a ``llama_token_data_array`` this object owns (no per-step
    allocation): numpy holds the data, a ctypes header points at it."""

    def __init__(self, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._data = np.zeros(n_vocab, dtype=TOKEN_DATA_DTYPE)
        self._pointer = ctypes.cast(self._data.ctypes.data, L.llama_token_data_p)
        self.array = L.llama_token_data_array(self._pointer, n_vocab, -1, False)

    def load(self, ctx: int, row: int) -> None:
        """Fill from the logits of batch row ``row`` (samplers reorder and shrink it)."""
        logits = row_logits(ctx, row, self._n_vocab)
        self._data["id"] = self._ids
        self._data["logit"] = logits
        self._data["p"] = 0.0
        array = self.array
        array.data = self._pointer  # type: ignore[assignment]  # llama-cpp-python declares a pointer field as an array
        array.size = self._n_vocab
        array.selected = -1
        array.sorted = False

    def apply(self, sampler: int) -> None:
        L.llama_sampler_apply(sampler, ctypes.byref(self.array))

    def num_allowed(self) -> int:
        """Candidates with a finite logit (what the grammar and the biases left)."""
        size = int(self.array.size)
        return int(np.isfinite(self._data["logit"][:size]).sum())

    def narrow(self, keep: int) -> bool:
        """Keep only the ``keep`` highest logits; False (unchanged) when that is all."""
        size = int(self.array.size)
        if keep >= size:
            return False
        data = self._data[:size]
        top = np.argpartition(data["logit"], size - keep)[size - keep:]
        self._data[:keep] = data[top]  # fancy indexing copies before the write
        self.array.size = keep
        self.array.sorted = False
        return True

    def selected_token(self) -> int:
        array = self.array
        if not 0 <= array.selected < array.size:
            raise RuntimeError(f"sampler chain selected no token (selected={array.selected})")
        return int(array.data[array.selected].id)


class GrammarSampler:
    """One session's grammar state (``llama_sampler_init_grammar``).

    Raises:
        GrammarError: The grammar does not parse.
    """

    def __init__(self, vocab: int, text: str) -> None:
        self._sampler = L.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not self._sampler:
            raise GrammarError("llama.cpp could not parse the grammar")
        self._single = L.llama_token_data(0, 0.0, 0.0)
        self._single_array = L.llama_token_data_array(ctypes.pointer(self._single), 1, -1, False)

    @property
    def sampler(self) -> int:
        return self._sampler

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (one-candidate apply: cheap)."""
        single = self._single
        single.id = token  # type: ignore[assignment]  # ctypes converts an int field
        single.logit = 1.0
        single.p = 0.0
        array = self._single_array
        array.size = 1
        array.selected = -1
        array.sorted = False
        L.llama_sampler_apply(self._sampler, ctypes.byref(array))
        return not math.isinf(single.logit)

    def accept(self, token: int) -> None:
        """Advance past ``token``; the caller made sure :meth:`allows` holds.

        NOTE: llama.cpp aborts the process on a token its grammar rejects, so nothing
        unchecked may reach this call.
        """
        L.llama_sampler_accept(self._sampler, token)

    def replay(self, tokens: Iterable[int]) -> None:
        """Accept tokens generated before this sampler existed (a rebuilt session).

        Raises:
            GrammarError: A token does not fit (the session diverged from its grammar).
        """
        for token in tokens:
            if not self.allows(int(token)):
                raise GrammarError(f"token {token} of the generated text does not fit the grammar")
            self.accept(int(token))

    def close(self) -> None:
        if self._sampler:
            L.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:  # pragma: no cover - safety net; close() is the contract
        self.close()


@dataclass(frozen=True, slots=True)
class ConstrainedSampler:
    """What one constrained draw needs: the session's two chains, grammar and buffer."""

    adjusting: int
    """The chain that changes logits (biases, penalties)."""
    choosing: int
    """The chain that picks (greedy, or truncation, temperature and the draw)."""
    grammar: GrammarSampler
    candidates: Candidates
    kept_tokens: int | None
    """Most tokens ``choosing`` can keep (1, ``top_k``), or None when unbounded."""


def sample_constrained(sampler: ConstrainedSampler, ctx: int, row: int,
                       fallback_token: int) -> int:
    """Sample from row ``row`` under the grammar and accept the token everywhere.

    Returns ``fallback_token`` (an end-of-generation token) without accepting it when the
    grammar admits no token at all: generation then ends instead of emitting text the
    grammar forbids.
    """
    candidates, grammar = sampler.candidates, sampler.grammar
    candidates.load(ctx, row)
    candidates.apply(sampler.adjusting)
    candidates.apply(sampler.choosing)
    token = candidates.selected_token()
    if not grammar.allows(token):
        resampled = _resample(sampler, ctx, row)
        if resampled is None:
            logger.warning("the grammar admits no token here: ending the generation")
            return fallback_token
        token = resampled
    grammar.accept(token)
    L.llama_sampler_accept(sampler.adjusting, token)
    L.llama_sampler_accept(sampler.choosing, token)
    return token


def _resample(sampler: ConstrainedSampler, ctx: int, row: int) -> int | None:
    """Draw from the candidates the grammar allows; None when it allows none.

    When the choosing samplers keep at most ``k`` tokens (greedy: 1, ``top_k``: k), only
    the most likely few are filtered first: if ``k`` of them pass, they are the ``k`` best
    tokens the grammar allows, so the draw equals one over the filtered whole vocabulary
    at a fraction of the cost. Otherwise the whole vocabulary is filtered.
    """
    candidates = sampler.candidates
    kept = sampler.kept_tokens
    candidates.load(ctx, row)
    candidates.apply(sampler.adjusting)
    if kept is not None and candidates.narrow(max(_NARROW_MIN, _NARROW_FACTOR * kept)):
        candidates.apply(sampler.grammar.sampler)
        if candidates.num_allowed() >= kept:
            candidates.apply(sampler.choosing)
            return candidates.selected_token()
        candidates.load(ctx, row)
        candidates.apply(sampler.adjusting)
    candidates.apply(sampler.grammar.sampler)
    if candidates.num_allowed() == 0:
        return None
    candidates.apply(sampler.choosing)
    return candidates.selected_token()
