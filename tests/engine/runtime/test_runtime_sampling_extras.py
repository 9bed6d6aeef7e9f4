"""Grammars, log-probabilities and session forks on real llama.cpp with the tiny model."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from skippyd.engine.runtime.constrained import GrammarError
from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationRequest,
    RowPhase,
    SamplingConfig,
)
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.tokenizer import Tokenizer

GRAMMAR = 'root ::= ("cat" | "dog") " and " [a-z]{2,5} "."'
TEXT = re.compile(r"(cat|dog) and [a-z]{2,5}\.")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    tok = Tokenizer(tiny_model_path)
    yield tok
    tok.close()


@pytest.fixture
def runtime(tiny_model_path):
    with LlamaRuntime(RuntimeOptions(str(tiny_model_path), lane_count=4, ctx_size=256,
                                     n_batch=128, n_ubatch=32, threads=2)) as rt:
        yield rt


def run(rt, prompts: dict[str, list[int]], configs: dict[str, SamplingConfig], steps: int,
        ) -> dict[str, list]:
    """Prefill all sessions in one batch, then decode them together; samples per session."""
    requests = [IterationRequest(s, toks, sampling=configs[s], sample_last=True)
                for s, toks in prompts.items()]
    samples: dict[str, list] = {s: [] for s in prompts}
    for _ in range(steps):
        out = rt.run_iteration(requests)
        for sample in out.samples:
            samples[requests[sample.request_index].session_id].append(sample)
        requests = [IterationRequest(s, [got[-1].token], sampling=configs[s], sample_last=True,
                                     phase=RowPhase.DECODE)
                    for s, got in samples.items() if not got[-1].is_eog]
        if not requests:
            break
    return samples


def text_of(tokenizer, samples) -> str:
    return tokenizer.detokenize([s.token for s in samples if not s.is_eog])


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_grammar_constrains_the_text_and_ends_it(runtime, tokenizer, temperature):
    prompt = tokenizer.tokenize("the cat")
    config = SamplingConfig(temperature=temperature, seed=3, grammar=GRAMMAR,
                            grammar_start=len(prompt))
    samples = run(runtime, {"a": prompt}, {"a": config}, steps=40)["a"]
    assert samples[-1].is_eog, "the grammar's end must end the generation"
    assert TEXT.fullmatch(text_of(tokenizer, samples))


def test_free_text_does_not_follow_the_grammar(runtime, tokenizer):
    """The tiny model's own greedy text is not grammatical: the constraint is doing work."""
    prompt = tokenizer.tokenize("the cat")
    samples = run(runtime, {"a": prompt}, {"a": SamplingConfig(temperature=0.0)}, steps=12)["a"]
    assert not TEXT.fullmatch(text_of(tokenizer, samples))


def test_a_constrained_neighbour_changes_nothing_for_a_plain_session(runtime, tokenizer):
    plain_prompt = tokenizer.tokenize("hello world")
    other_prompt = tokenizer.tokenize("the cat")
    greedy = SamplingConfig(temperature=0.0)
    constrained = SamplingConfig(temperature=0.0, grammar=GRAMMAR,
                                 grammar_start=len(other_prompt))
    # Same batch shapes both times (shapes change the arithmetic): only the neighbour's sampling differs.
    with_plain = run(runtime, {"p": plain_prompt, "o": other_prompt},
                     {"p": greedy, "o": greedy}, steps=6)
    for session in ("p", "o"):
        runtime.drop_session(session)
    with_grammar = run(runtime, {"p": plain_prompt, "o": other_prompt},
                       {"p": greedy, "o": constrained}, steps=6)
    assert [s.token for s in with_plain["p"]] == [s.token for s in with_grammar["p"]]
    assert [s.token for s in with_plain["o"]] != [s.token for s in with_grammar["o"]]


def test_a_rebuilt_sampler_replays_the_generated_tokens_into_its_grammar(runtime, tokenizer):
    prompt = tokenizer.tokenize("the cat")
    config = SamplingConfig(temperature=0.0, grammar=GRAMMAR, grammar_start=len(prompt))
    first = run(runtime, {"a": prompt}, {"a": config}, steps=5)["a"]
    tokens = [s.token for s in first]
    # Trim the last pending token away: the session's sampler is rebuilt on the next sample
    # and must pick up the grammar where the four accepted tokens left it.
    runtime.trim_session("a", len(prompt) + 3)
    out = runtime.run_iteration([IterationRequest(
        "a", [tokens[3]], sampling=config, sample_last=True, phase=RowPhase.DECODE)])
    rest = run_from(runtime, "a", out.samples[0], config, steps=40)
    assert TEXT.fullmatch(tokenizer.detokenize(tokens[:4] + [s.token for s in rest if not s.is_eog]))


def run_from(rt, session: str, sample, config: SamplingConfig, steps: int) -> list:
    samples = [sample]
    while not samples[-1].is_eog and len(samples) < steps:
        out = rt.run_iteration([IterationRequest(
            session, [samples[-1].token], sampling=config, sample_last=True,
            phase=RowPhase.DECODE)])
        samples.append(out.samples[0])
    return samples


def test_an_unparsable_grammar_is_refused_before_it_runs(tokenizer):
    tokenizer.check_grammar(GRAMMAR)
    for bad in ('root ::= "a', 'start ::= "a"', "root ::= root \"a\"", "root ::= missing"):
        with pytest.raises(GrammarError):
            tokenizer.check_grammar(bad)


def test_logprobs_are_the_log_softmax_of_the_row(runtime, tokenizer):
    prompt = tokenizer.tokenize("a dog")
    config = SamplingConfig(temperature=0.0, logprobs=3)
    sample = run(runtime, {"a": prompt}, {"a": config}, steps=1)["a"][0]
    entry = sample.logprob
    assert entry is not None and entry.token == sample.token
    assert len(entry.top) == 3
    # Greedy takes the most likely token; the alternatives are sorted and normalised.
    assert entry.top[0] == (sample.token, pytest.approx(entry.logprob, abs=1e-6))
    values = [lp for _, lp in entry.top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6


def test_no_logprobs_unless_asked(runtime, tokenizer):
    sample = run(runtime, {"a": tokenizer.tokenize("a dog")},
                 {"a": SamplingConfig(temperature=0.0)}, steps=1)["a"][0]
    assert sample.logprob is None


def test_prompt_logprobs_are_the_same_whole_or_in_chunks(runtime, tokenizer):
    prompt = tokenizer.tokenize("the cat and the dog is in the world")
    config = SamplingConfig(temperature=0.0, prompt_logprobs=2)
    whole = runtime.run_iteration(
        [IterationRequest("w", prompt, sampling=config, sample_last=True)])
    entries = dict(whole.prompt_logprobs[0])
    assert sorted(entries) == list(range(1, len(prompt)))
    assert all(entries[p].token == prompt[p] for p in entries)
    chunked: dict = {}
    cut = len(prompt) // 2
    for chunk, start in ((prompt[:cut], 0), (prompt[cut:], cut)):
        out = runtime.run_iteration([IterationRequest(
            "c", chunk, positions=range(start, start + len(chunk)), sampling=config,
            sample_last=start == cut)])
        chunked.update(out.prompt_logprobs[0])
    assert sorted(chunked) == sorted(entries)
    for position, entry in entries.items():  # different batch shapes: a tolerance
        assert chunked[position].logprob == pytest.approx(entry.logprob, abs=1e-3)
        assert [t for t, _ in chunked[position].top] == [t for t, _ in entry.top]


def test_a_forked_session_continues_like_a_fresh_one(runtime, tokenizer):
    prompt = tokenizer.tokenize("the dog is in the world and")
    greedy = SamplingConfig(temperature=0.0)
    fresh = run(runtime, {"fresh": prompt}, {"fresh": greedy}, steps=8)["fresh"]
    source = run(runtime, {"src": prompt}, {"src": greedy}, steps=1)["src"]
    runtime.fork_session("src", "copy")
    assert runtime.session_history("copy") == tuple(prompt)
    forked = run_from(runtime, "copy", source[0], greedy, steps=8)
    assert [s.token for s in forked] == [s.token for s in fresh]
    # A partial fork recomputes the last prompt token itself, and continues the same way.
    runtime.fork_session("src", "partial", len(prompt) - 1)
    assert runtime.session_token_count("partial") == len(prompt) - 1
    out = runtime.run_iteration([IterationRequest(
        "partial", prompt[-1:], positions=[len(prompt) - 1], sampling=greedy, sample_last=True)])
    partial = run_from(runtime, "partial", out.samples[0], greedy, steps=8)
    assert [s.token for s in partial] == [s.token for s in fresh]


def test_a_fork_is_checked_and_leaves_the_source_alone(runtime, tokenizer):
    prompt = tokenizer.tokenize("hello world")
    run(runtime, {"src": prompt}, {"src": SamplingConfig(temperature=0.0)}, steps=1)
    with pytest.raises(InvalidIterationError):
        runtime.fork_session("missing", "dst")
    with pytest.raises(InvalidIterationError):
        runtime.fork_session("src", "dst", len(prompt) + 1)
    with pytest.raises(InvalidIterationError):
        runtime.fork_session("src", "src")
    assert runtime.session_token_count("dst") is None
    runtime.fork_session("src", "dst", 2)
    runtime.drop_session("dst")
    assert runtime.session_history("src") == tuple(prompt)
    assert runtime.session_token_count("src") == len(prompt)


@pytest.mark.parametrize("config", [
    SamplingConfig(temperature=0.0),
    SamplingConfig(temperature=1.0, top_k=5, seed=7),
    SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3),
    SamplingConfig(temperature=0.7, top_k=3, seed=1, repeat_penalty=1.3, logit_bias=((100, 5.0),)),
])
def test_filtering_the_best_candidates_first_draws_what_filtering_all_draws(
        runtime, tokenizer, config):
    """The resample after a refused token: narrowed first or over the whole vocabulary,
    the same token comes out (fresh chains with the same seed each time)."""
    from skippyd.engine.runtime.constrained import ConstrainedSampler, _resample
    from skippyd.engine.runtime.sampling import SamplerChain

    prompt = tokenizer.tokenize("the cat and the dog")
    runtime.run_iteration([IterationRequest("a", prompt, sample_last=True)])
    grammars = ('root ::= [a-m]+', 'root ::= "dog" | "cat" | [x-z]', 'root ::= [^e]+')

    def draw(grammar: str, narrowing: bool) -> int | None:
        chain = SamplerChain(dataclasses.replace(config, grammar=grammar),
                             n_vocab=runtime.n_vocab, n_ctx=runtime.n_ctx,
                             eog_tokens=runtime.eog_tokens, vocab=runtime._vocab)
        chain.observe(prompt)
        sampler = ConstrainedSampler(chain._chain, chain._choosing, chain._grammar,
                                     chain._candidates,
                                     sampler_bound(config) if narrowing else None)
        try:
            return _resample(sampler, runtime.context, len(prompt) - 1)
        finally:
            chain.close()

    for grammar in grammars:
        assert draw(grammar, True) == draw(grammar, False)


def sampler_bound(config: SamplingConfig) -> int:
    return 1 if config.is_greedy else config.top_k
