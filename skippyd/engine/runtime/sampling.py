"""Per-session sampler chains over llama.cpp's sampler API (DESIGN.md item 1).

A chain samples from the logits of one batch row (``llama_sampler_sample(chain, ctx, i)``)
and remembers the session's tokens for the penalties. Only the worker thread uses it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.protocol import SamplingConfig


def _has_penalties(config: SamplingConfig) -> bool:
    return (
        config.repeat_penalty != 1.0
        or config.presence_penalty != 0.0
        or config.frequency_penalty != 0.0
    )


class SamplerChain:
    """One llama.cpp sampler chain for one session.

    The chain must see every token of the session once, in order, for the penalties:
    :meth:`observe` feeds tokens that entered the KV; a token it sampled itself has already
    been seen (``llama_sampler_sample`` accepts it), so the next observed token is skipped
    when it is that token.
    """

    def __init__(
        self,
        config: SamplingConfig,
        *,
        n_vocab: int,
        n_ctx: int,
        eog_tokens: Sequence[int],
    ) -> None:
        self.config = config
        self.tracks_history = _has_penalties(config)
        self._pending_sampled: int | None = None
        self._n_vocab = n_vocab
        # Plain greedy needs no chain: an argmax over the row's logits picks the same
        # token (the first highest, as llama.cpp's greedy sampler does) in a third of
        # the time, without filling a candidate array of the whole vocabulary.
        self._argmax = config.is_greedy and not self.tracks_history and not config.logit_bias
        self._masked = np.array(sorted(eog_tokens) if config.ignore_eos else [], dtype=np.intp)
        params = L.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain = L.llama_sampler_chain_init(params)
        if not self._chain:
            raise MemoryError("llama_sampler_chain_init failed")
        for sampler in _build_samplers(config, n_vocab=n_vocab, n_ctx=n_ctx, eog_tokens=eog_tokens):
            L.llama_sampler_chain_add(self._chain, sampler)

    def observe(self, tokens: Iterable[int]) -> None:
        """Tell the penalties about tokens that entered the session's KV."""
        if not self.tracks_history:
            return
        for token in tokens:
            if self._pending_sampled is not None:
                already_seen = token == self._pending_sampled
                self._pending_sampled = None
                if already_seen:
                    continue
            L.llama_sampler_accept(self._chain, int(token))

    def sample(self, ctx: int, row: int) -> int:
        """Sample from the logits of batch row ``row`` (that row must be an output)."""
        if self._argmax:
            return self._greedy(ctx, row)
        token = int(L.llama_sampler_sample(self._chain, ctx, row))
        self._pending_sampled = token
        return token

    def _greedy(self, ctx: int, row: int) -> int:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(self._n_vocab,))
        token = int(logits.argmax())
        if self._masked.size and token in self._masked:  # ignore_eos: never end
            masked = logits.copy()
            masked[self._masked] = -np.inf
            token = int(masked.argmax())
        return token

    def close(self) -> None:
        if self._chain:
            L.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - safety net; close() is the contract
        self.close()


def _build_samplers(config: SamplingConfig, *, n_vocab: int, n_ctx: int, eog_tokens):
    biases = list(config.logit_bias)
    if config.ignore_eos:
        biases.extend((token, float("-inf")) for token in eog_tokens)
    if biases:
        array = (L.llama_logit_bias * len(biases))(
            *(L.llama_logit_bias(int(t), float(b)) for t, b in biases)
        )
        yield L.llama_sampler_init_logit_bias(n_vocab, len(biases), array)
    if _has_penalties(config):
        # NOTE: the sampler allocates its history up front: never beyond the context.
        last_n = n_ctx if config.penalty_last_n == -1 else min(config.penalty_last_n, n_ctx)
        yield L.llama_sampler_init_penalties(
            n_vocab, last_n, config.repeat_penalty, config.frequency_penalty, config.presence_penalty
        )
    if config.is_greedy:
        yield L.llama_sampler_init_greedy()
        return
    if config.top_k > 0:
        yield L.llama_sampler_init_top_k(config.top_k)
    if config.typical_p < 1.0:
        yield L.llama_sampler_init_typical(config.typical_p, 1)
    if config.top_p < 1.0:
        yield L.llama_sampler_init_top_p(config.top_p, 1)
    if config.min_p > 0.0:
        yield L.llama_sampler_init_min_p(config.min_p, 1)
    yield L.llama_sampler_init_temp(config.temperature)
    seed = L.LLAMA_DEFAULT_SEED if config.seed is None else config.seed & 0xFFFFFFFF
    yield L.llama_sampler_init_dist(ctypes.c_uint32(seed).value)
