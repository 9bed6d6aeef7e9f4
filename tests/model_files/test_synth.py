"""Synthesized models of real shapes: written streamed, loaded and run by llama.cpp.

The named shapes are too large for a test; the library is checked on tiny shapes with
the embedded model's real tokenizer, and the command on the 0.5b shape cut to one layer.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.engine.runtime.contract import IterationRequest, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.tokenizer import Tokenizer
from skippyd.model_files.model_info import inspect_model
from skippyd.model_files.synth import (
    SHAPES,
    ModelShape,
    read_tokenizer,
    shape_named,
    write_f16_model,
)

runner = CliRunner()
TEXT = "Hello world, the cat sat on the mat. Skippyd serves models!"


def tiny_shape(n_vocab: int, *, tied: bool = False) -> ModelShape:
    return ModelShape("tiny", "nothing", n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128,
                      n_vocab=n_vocab, tied_embeddings=tied)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return read_tokenizer(smollm2_path)


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy_tokens(path, prompt: list[int], steps: int) -> list[int]:
    options = RuntimeOptions(str(path), lane_count=1, ctx_size=256, n_batch=64, n_ubatch=64,
                             threads=2)
    with LlamaRuntime(options) as runtime:
        greedy = SamplingConfig(temperature=0.0)
        out = runtime.run_iteration([IterationRequest("s", token_ids=prompt, sampling=greedy,
                                                      sample_last=True)])
        tokens = [out.samples[0].token]
        for _ in range(steps - 1):
            out = runtime.run_iteration([IterationRequest("s", token_ids=[tokens[-1]],
                                                          sampling=greedy, sample_last=True)])
            tokens.append(out.samples[0].token)
    return tokens


def test_a_padded_vocabulary_keeps_the_source_tokenizer_and_template(
        tmp_path, smollm2_path, smollm2_tokenizer):
    n_vocab = len(smollm2_tokenizer.tokens) + 100
    path = write_f16_model(tiny_shape(n_vocab), tmp_path / "padded.gguf", smollm2_tokenizer,
                           n_ctx=4096)
    info = inspect_model(path)
    assert (info.architecture, info.n_layer, info.n_embd, info.n_vocab, info.n_ctx_train) == (
        "llama", 2, 64, n_vocab, 4096)
    assert info.has_chat_template and info.quantization == "F16"
    ours, theirs = Tokenizer(path), Tokenizer(smollm2_path)
    try:
        assert ours.tokenize(TEXT) == theirs.tokenize(TEXT)
        chat = [{"role": "user", "content": "hi"}]
        assert ours.render_chat(chat) == theirs.render_chat(chat)
        assert ours.detokenize(ours.tokenize(TEXT, add_special=False)) == TEXT
    finally:
        ours.close()
        theirs.close()


def test_a_cut_vocabulary_still_tokenizes_every_text_within_it(tmp_path, smollm2_tokenizer):
    path = write_f16_model(tiny_shape(32_000), tmp_path / "cut.gguf", smollm2_tokenizer)
    assert inspect_model(path).n_vocab == 32_000
    tok = Tokenizer(path)
    try:
        ids = tok.tokenize(TEXT + " 🦙 naïve", add_special=False)
        assert ids and max(ids) < 32_000
        assert tok.detokenize(ids) == TEXT + " 🦙 naïve"
    finally:
        tok.close()


def test_a_vocabulary_that_drops_a_special_token_is_refused(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match="special tokens"):
        write_f16_model(tiny_shape(2), tmp_path / "x.gguf", smollm2_tokenizer)


def test_the_same_seed_writes_the_same_model_and_llama_cpp_runs_it(tmp_path, smollm2_tokenizer):
    shape = tiny_shape(len(smollm2_tokenizer.tokens), tied=True)
    first = write_f16_model(shape, tmp_path / "a.gguf", smollm2_tokenizer, seed=7)
    again = write_f16_model(shape, tmp_path / "b.gguf", smollm2_tokenizer, seed=7)
    other = write_f16_model(shape, tmp_path / "c.gguf", smollm2_tokenizer, seed=8)
    assert digest(first) == digest(again) != digest(other)
    assert first.stat().st_size == other.stat().st_size
    prompt = [1, 504, 2210, 30]
    assert greedy_tokens(first, prompt, 4) == greedy_tokens(again, prompt, 4)


def test_the_tensors_are_streamed_not_held(tmp_path, smollm2_path):
    # One output head of 151 936 x 896: 272 MB at f16, 545 MB as the float32 it is drawn
    # in. Written in chunks, the writer's peak stays far below either.
    code = (
        "import resource, sys\n"
        "from skippyd.model_files.synth import read_tokenizer, shape_named, write_f16_model\n"
        "tok = read_tokenizer(sys.argv[1])\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "write_f16_model(shape_named('0.5b', n_layer=1), sys.argv[2], tok)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = tmp_path / "head.gguf"
    result = subprocess.run([sys.executable, "-c", code, str(smollm2_path), str(out)],
                            capture_output=True, text=True, timeout=300, check=True)
    grown_mib = int(result.stdout.strip()) / 1024
    assert out.stat().st_size > 272 * 10**6
    assert grown_mib < 160, f"the writer grew by {grown_mib:.0f} MiB"


def test_named_shapes_have_the_real_models_sizes():
    assert SHAPES["1b"].parameter_count() == pytest.approx(1.1e9, rel=0.02)
    assert SHAPES["0.5b"].parameter_count() == pytest.approx(0.49e9, rel=0.03)
    assert SHAPES["3b"].parameter_count() == pytest.approx(3.2e9, rel=0.03)
    assert SHAPES["8b"].parameter_count() == pytest.approx(8.03e9, rel=0.02)
    assert SHAPES["8b"].kv_bytes_per_token() == 131_072  # 128 KiB per token at f16
    assert shape_named("1b", n_layer=3).n_layer == 3
    with pytest.raises(ValueError, match="unknown shape"):
        shape_named("2b")
    with pytest.raises(ValueError, match="multiple of n_head"):
        ModelShape("bad", "x", n_embd=100, n_layer=1, n_head=3, n_head_kv=1, n_ff=8, n_vocab=8)


def test_the_command_writes_a_quantized_model_llama_cpp_serves(tmp_path):
    out = tmp_path / "half.gguf"
    result = runner.invoke(app, ["model", "synth", "--shape", "0.5b", "--layers", "1",
                                 "--vocab", "49152", "--quant", "q4_0", "--seed", "3",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "Qwen2.5-0.5B shape" in result.output and "Q4_0" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.gguf"]  # no partial left
    shown = runner.invoke(app, ["model", "inspect", "--json", str(out)])
    info = json.loads(shown.output)
    assert (info["n_layer"], info["n_embd"], info["n_vocab"], info["n_ctx_train"]) == (
        1, 896, 49152, 8192)
    assert info["quantization"] == "Q4_0"
    tokens = greedy_tokens(out, [1, 504, 2210], 3)
    assert len(tokens) == 3 and all(0 <= t < 49152 for t in tokens)


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "2b"], "unknown shape"),
    (["--shape", "1b", "--quant", "Q3_K"], "choose one of"),
    (["--shape", "1b", "--layers", "0"], "--layers"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, args, message):
    result = runner.invoke(app, ["model", "synth", *args, "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code == 2
    assert message in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_output_in_a_missing_directory_is_refused(tmp_path):
    result = runner.invoke(app, ["model", "synth", "--shape", "1b",
                                 "-o", str(tmp_path / "nowhere" / "m.gguf")])
    assert result.exit_code == 1
    assert "does not exist" in result.output
    assert list(tmp_path.iterdir()) == []


def test_weights_are_small_noise_and_norms_are_ones(tmp_path, smollm2_tokenizer):
    import gguf

    path = write_f16_model(tiny_shape(len(smollm2_tokenizer.tokens)), tmp_path / "w.gguf",
                           smollm2_tokenizer)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert set(tensors) == {name for name, _ in tiny_shape(1).tensors()}
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert q.shape == (64, 64) and 0.015 < q.std() < 0.025
    assert np.all(np.asarray(tensors["blk.1.ffn_norm.weight"].data) == 1.0)
