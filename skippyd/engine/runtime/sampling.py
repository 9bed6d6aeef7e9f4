"""Per-session sampler chains over llama.cpp's sampler API.

A chain samples from the logits of one batch row (``llama_sampler_sample(chain, ctx, i)``)
and remembers the session's tokens for the penalties. A session with a grammar samples
through :func:`~skippyd.engine.runtime.constrained.sample_constrained` instead, on a
candidate array of its own. Only the worker thread uses it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.constrained import (
    Candidates,
    ConstrainedSampler,
    GrammarSampler,
    sample_constrained,
)
from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.engine.runtime.token_logprobs import row_logits


def is_plain_greedy(config: SamplingConfig) -> bool:
    """Whether the token is the argmax of the row's logits (no chain needed)."""
    return (config.is_greedy and not _has_penalties(config) and not config.logit_bias
            and config.grammar is None)


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
        vocab: int | None = None,
    ) -> None:
        self.config = config
        self.tracks_history = _has_penalties(config)
        self._pending_sampled: int | None = None
        self._n_vocab = n_vocab
        # Plain greedy needs no chain: an argmax over the row's logits picks the same
        # token (the first highest, as llama.cpp's greedy sampler does) without filling
        # a candidate array of the whole vocabulary.
        self._argmax = is_plain_greedy(config)
        self._masked = np.array(sorted(eog_tokens) if config.ignore_eos else [], dtype=np.intp)
        self._masked_set = frozenset(self._masked.tolist())
        self._eog_token = eog_tokens[0] if eog_tokens else 0
        pre = list(_adjusting_samplers(config, n_vocab=n_vocab, n_ctx=n_ctx,
                                       eog_tokens=eog_tokens))
        self._grammar: GrammarSampler | None = None
        self._candidates: Candidates | None = None
        self._choosing: int | None = None
        if config.grammar is None:
            self._chain = _new_chain([*pre, *_choosing_samplers(config)])
            return
        # NOTE: a constrained session keeps the logit adjustments (bias, penalties) and
        # the choice (truncation, temperature, draw) in two chains, so the grammar can
        # filter between them (see sample_constrained).
        if vocab is None:
            raise ValueError("a grammar needs the model's vocabulary")
        self._chain = _new_chain(pre)
        self._choosing = _new_chain(list(_choosing_samplers(config)))
        self._grammar = GrammarSampler(vocab, config.grammar)
        self._candidates = Candidates(n_vocab)

    def replay_grammar(self, history: Sequence[int]) -> None:
        """Bring a new grammar up to date with tokens generated before it existed.

        Raises:
            GrammarError: The tokens do not fit the grammar.
        """
        if self._grammar is not None:
            self._grammar.replay(history[self.config.grammar_start:])

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

    def sample(self, ctx: int, row: int, argmax: int | None = None) -> int:
        """Sample from the logits of batch row ``row`` (that row must be an output).

        ``argmax``: the row's argmax when the caller already has it (the runtime picks
        every plain-greedy row of a step in one numpy call).
        """
        if self._argmax:
            return self._greedy(ctx, row, argmax)
        if self._grammar is None:
            token = int(L.llama_sampler_sample(self._chain, ctx, row))
        else:
            assert self._candidates is not None and self._choosing is not None
            token = sample_constrained(
                ConstrainedSampler(self._chain, self._choosing, self._grammar,
                                   self._candidates, _kept_tokens(self.config)),
                ctx, row, self._eog_token)
        self._pending_sampled = token
        return token

    def _greedy(self, ctx: int, row: int, argmax: int | None) -> int:
        token = int(row_logits(ctx, row, self._n_vocab).argmax()) if argmax is None else argmax
        # NOTE: a set, not ``in`` over the numpy array: right after a decode numpy's
        # dispatch costs more than the argmax itself.
        if token in self._masked_set:  # ignore_eos: never end
            masked = row_logits(ctx, row, self._n_vocab).copy()
            masked[self._masked] = -np.inf
            token = int(masked.argmax())
        return token

    def close(self) -> None:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None
        if self._choosing:
            L.llama_sampler_free(self._choosing)
            self._choosing = None
        if self._chain:
            L.llama_sampler_free(self._chain)
            self._chain = 0  # freed: a null sampler

    def __del__(self) -> None:  # pragma: no cover - safety net; close() is the contract
        self.close()


def _new_chain(samplers: list[int]) -> int:
    params = L.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = L.llama_sampler_chain_init(params)
    if not chain:
        for sampler in samplers:
            L.llama_sampler_free(sampler)
        raise MemoryError("llama_sampler_chain_init failed")
    for sampler in samplers:
        L.llama_sampler_chain_add(chain, sampler)
    return chain


def _kept_tokens(config: SamplingConfig) -> int | None:
    """How many tokens the choosing samplers can ever keep: 1 (greedy), ``top_k``, or
    None when no fixed bound exists (they may draw from the whole vocabulary)."""
    if config.is_greedy:
        return 1
    return config.top_k if config.top_k > 0 else None


def _adjusting_samplers(config: SamplingConfig, *, n_vocab: int, n_ctx: int, eog_tokens):
    """Samplers that change logits: biases (``ignore_eos`` included) and penalties."""
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


def _choosing_samplers(config: SamplingConfig):
    """Samplers that pick the token: greedy, or truncation, temperature and the draw."""
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
