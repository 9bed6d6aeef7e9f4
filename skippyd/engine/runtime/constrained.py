"""Grammar-constrained sampling over llama.cpp's grammar sampler.

llama.cpp's grammar sampler checks every candidate token against the grammar; over a
vocabulary of tens of thousands of tokens that costs far more than the rest of the
chain. So, as llama.cpp's own common sampler does, a constrained session first samples
*without* the grammar and only asks the grammar about that one token; only when the
grammar rejects it are all candidates filtered and the chain applied again. Most tokens
of a structured answer are the model's own first choice, so most steps pay one
single-token check. Every sampled token is then accepted by the grammar and the chain.

Only the worker thread uses these objects (the HTTP side only parses a grammar once with
:func:`check_grammar`, on a vocabulary of its own).
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Iterable

import numpy as np
from llama_cpp import llama_cpp as L

logger = logging.getLogger(__name__)

#: ``llama_token_data`` laid out as numpy sees it (int32 id, float logit, float p).
TOKEN_DATA_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


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
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(self._n_vocab,))
        self._data["id"] = self._ids
        self._data["logit"] = logits
        self._data["p"] = 0.0
        array = self.array
        array.data = self._pointer
        array.size = self._n_vocab
        array.selected = -1
        array.sorted = False

    def apply(self, sampler: int) -> None:
        L.llama_sampler_apply(sampler, ctypes.byref(self.array))

    def any_allowed(self) -> bool:
        """Whether some candidate still has a finite logit (the grammar left a choice)."""
        size = int(self.array.size)
        return bool(np.isfinite(self._data["logit"][:size]).any())

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
        single.id = token
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


def sample_constrained(chain: int, grammar: GrammarSampler, candidates: Candidates,
                       ctx: int, row: int, fallback_token: int) -> int:
    """Sample from row ``row`` with ``chain``, constrained by ``grammar``; accept the token.

    Returns ``fallback_token`` (an end-of-generation token) without accepting it when the
    grammar admits no token at all: generation then ends instead of emitting text the
    grammar forbids.
    """
    candidates.load(ctx, row)
    candidates.apply(chain)
    token = candidates.selected_token()
    if not grammar.allows(token):
        candidates.load(ctx, row)
        candidates.apply(grammar.sampler)
        if not candidates.any_allowed():
            logger.warning("the grammar admits no token here: ending the generation")
            return fallback_token
        candidates.apply(chain)
        token = candidates.selected_token()
    grammar.accept(token)
    L.llama_sampler_accept(chain, token)
    return token
