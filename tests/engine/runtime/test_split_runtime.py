"""Split equals unsplit: SmolLM2 cut into 2 and 3 stages, chained in process.

Each stage is a real sliced GGUF loaded by stock llama.cpp; stage k's captured ``l_out``
rows are stage k+1's input. For the same batches, the chain's greedy tokens must equal
the whole model's, bit for bit, with several sessions per batch and a prompt longer than
``n_ubatch``. The whole model and the slices are loaded once per module.
"""

from __future__ import annotations

import numpy as np
import pytest

from skippyd.engine.runtime import llama_ext, native
from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import (
    MIN_ROWS_PER_CALL,
    OUTPUT_BUFFER_BUDGET,
    LlamaRuntime,
    RuntimeOptions,
    output_window,
)
from skippyd.engine.runtime.tokenizer import Tokenizer
from skippyd.model_files.slice import cached_slice

pytestmark = pytest.mark.model

N_UBATCH = 16
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    # Longer than n_ubatch: the non-final stages capture one chunk per micro-batch.
    "Water boils at a temperature of one hundred degrees Celsius at sea level, and it "
    "freezes at zero degrees. The three states of water are solid, liquid and",
]
STEPS = 10
GREEDY = SamplingConfig(temperature=0.0)


def _options(path, *, first=True, final=True, unified=False) -> RuntimeOptions:
    return RuntimeOptions(str(path), lane_count=4, ctx_size=512, n_batch=256,
                          n_ubatch=N_UBATCH, threads=2, first_stage=first, final_stage=final,
                          kv_unified=unified)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    tok = Tokenizer(smollm2_path)
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slices")


def _chain(smollm2_path, slice_dir, bounds, *, unified=False, rows_per_call=None):
    paths = [cached_slice(smollm2_path, a, b, slice_dir) for a, b in zip(bounds, bounds[1:], strict=False)]
    last = len(paths) - 1
    stages = [LlamaRuntime(_options(p, first=i == 0, final=i == last, unified=unified))
              for i, p in enumerate(paths)]
    if rows_per_call is not None:
        for stage in stages[:-1]:
            stage.rows_per_call = rows_per_call
    return stages


@pytest.fixture(params=["native", "python"])
def capture(request, monkeypatch) -> str:
    """Which capture callback the non-final stages use: both must reorder their rows
    from llama.cpp's per-stream micro-batch order back to batch order."""
    use_native = request.param == "native"
    if use_native and native.helpers().library is None:
        pytest.skip("the install built no native helpers")
    real = llama_ext.make_layer_capture
    monkeypatch.setattr("skippyd.engine.runtime.llama.make_layer_capture",
                        lambda *a, **k: real(*a, native=use_native))
    return "NativeLayerCapture" if use_native else "LayerOutputCapture"


def _step(stages, requests: list[IterationRequest]):
    """Run one iteration through every stage, handing rows downstream."""
    rows = None
    for index, stage in enumerate(stages):
        final = index == len(stages) - 1
        staged = [
            IterationRequest(
                r.session_id,
                r.token_ids if index == 0 else (),
                input_rows=None if index == 0 else rows[i],
                sampling=GREEDY,
                sample_last=final,
                phase=r.phase,
            )
            for i, r in enumerate(requests)
        ]
        out = stage.run_iteration(staged)
        rows = out.output_rows
    return out


def _generate(stages, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    requests = [IterationRequest(s, toks) for s, toks in prompts.items()]
    out = _step(stages, requests)
    generated = {requests[s.request_index].session_id: [s.token] for s in out.samples}
    for _ in range(STEPS - 1):
        requests = [IterationRequest(s, [g[-1]], phase=RowPhase.DECODE)
                    for s, g in generated.items()]
        out = _step(stages, requests)
        for sample in out.samples:
            generated[requests[sample.request_index].session_id].append(sample.token)
    for stage in stages:
        for session_id in prompts:
            stage.drop_session(session_id)
    return generated


@pytest.fixture(scope="module")
def unsplit(smollm2_path):
    with LlamaRuntime(_options(smollm2_path)) as rt:
        yield [rt]


@pytest.mark.parametrize("bounds", [(0, 15, 30), (0, 10, 20, 30)], ids=["2-stage", "3-stage"])
def test_split_chain_matches_unsplit_model(smollm2_path, slice_dir, tokenizer, unsplit, bounds,
                                           capture):
    prompts = {f"s{i}": tokenizer.tokenize(p) for i, p in enumerate(PROMPTS)}
    assert max(len(t) for t in prompts.values()) > N_UBATCH
    stages = _chain(smollm2_path, slice_dir, bounds)
    try:
        assert {type(stage._capture).__name__ for stage in stages[:-1]} == {capture}
        # Several sessions per batch.
        assert _generate(stages, prompts) == _generate(unsplit, prompts)
        # One at a time, including the prompt longer than n_ubatch.
        for session_id, toks in prompts.items():
            single = {session_id: toks}
            assert _generate(stages, single) == _generate(unsplit, single)
    finally:
        for stage in stages:
            stage.close()


def test_a_chain_in_one_kv_pool_matches_the_unsplit_model(smollm2_path, slice_dir,
                                                          tokenizer):
    """In one pool llama.cpp keeps a batch's rows in order: nothing to reorder."""
    prompts = {f"s{i}": tokenizer.tokenize(p) for i, p in enumerate(PROMPTS)}
    stages = _chain(smollm2_path, slice_dir, (0, 15, 30), unified=True)
    try:
        with LlamaRuntime(_options(smollm2_path, unified=True)) as whole:
            assert _generate(stages, prompts) == _generate([whole], prompts)
    finally:
        for stage in stages:
            stage.close()


def test_a_stage_that_runs_an_iteration_in_several_calls_matches_the_unsplit_model(
        smollm2_path, slice_dir, tokenizer, unsplit):
    """A non-final stage cuts an iteration into calls of ``rows_per_call`` rows; the
    rows it hands on are those of one call, in batch order."""
    prompts = {f"s{i}": tokenizer.tokenize(p) for i, p in enumerate(PROMPTS)}
    stages = _chain(smollm2_path, slice_dir, (0, 10, 20, 30), rows_per_call=5)
    try:
        calls_before = stages[0].decode_calls
        assert _generate(stages, prompts) == _generate(unsplit, prompts)
        rows = sum(len(t) for t in prompts.values()) + (STEPS - 1) * len(prompts)
        assert stages[0].decode_calls - calls_before >= rows / 5
    finally:
        for stage in stages:
            stage.close()


def test_a_failed_call_of_several_leaves_the_stage_as_it_was(
        smollm2_path, slice_dir, tokenizer, unsplit, monkeypatch):
    from llama_cpp import llama_cpp as L

    from skippyd.engine.runtime.contract import KvSlotUnavailableError

    prompts = {"s": tokenizer.tokenize(PROMPTS[2])}
    stages = _chain(smollm2_path, slice_dir, (0, 15, 30), rows_per_call=5)
    try:
        real, calls = L.llama_decode, []

        def second_call_fails(ctx, batch):
            calls.append(batch.n_tokens)
            return 1 if len(calls) == 2 else real(ctx, batch)

        monkeypatch.setattr(L, "llama_decode", second_call_fails)
        with pytest.raises(KvSlotUnavailableError):
            stages[0].run_iteration([IterationRequest("s", prompts["s"])])
        monkeypatch.undo()
        assert calls == [5, 5]
        assert stages[0].kv_cells_used() == 0
        assert stages[0].session_token_count("s") is None
        assert _generate(stages, prompts) == _generate(unsplit, prompts)
    finally:
        for stage in stages:
            stage.close()


def test_a_non_final_stage_bounds_what_llama_cpp_reserves_for_logits():
    """Every row of a non-final stage is an output, and llama.cpp reserves a vocabulary
    of floats for each output of a call: the rows per call keep that bounded."""
    for n_vocab in (32_000, 49_152, 128_256, 262_144):
        rows = output_window(n_vocab)
        assert rows >= MIN_ROWS_PER_CALL
        assert rows * n_vocab * 4 <= max(OUTPUT_BUFFER_BUDGET, MIN_ROWS_PER_CALL * n_vocab * 4)
    assert output_window(128_256) * 128_256 * 4 <= 32 << 20
    # A GPU reads its weights at every micro-batch: an offloading stage keeps them wide.
    assert output_window(128_256, at_least=512) == 512


def test_batched_logits_stay_close_to_solo(unsplit, tokenizer):
    """A prompt's logits batched with others stay within a stated tolerance of its logits
    alone, with the same argmax: the batch's shape changes which kernels run, not what a
    session attends to."""
    import ctypes

    from llama_cpp import llama_cpp as L

    rt = unsplit[0]
    prompts = [tokenizer.tokenize(p) for p in PROMPTS]

    def last_logits(row):
        ptr = L.llama_get_logits_ith(rt.context, row)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(rt.n_vocab,)).copy()

    rt.run_iteration([IterationRequest(f"b{i}", p, sample_last=True)
                                for i, p in enumerate(prompts)])
    rows = np.cumsum([len(p) for p in prompts]) - 1
    batched = [last_logits(int(r)) for r in rows]
    worst = 0.0
    for i, p in enumerate(prompts):
        rt.run_iteration([IterationRequest(f"solo{i}", p, sample_last=True)])
        solo = last_logits(len(p) - 1)
        worst = max(worst, float(np.max(np.abs(solo - batched[i]))))
        assert int(np.argmax(solo)) == int(np.argmax(batched[i]))
        rt.drop_session(f"solo{i}")
    for i in range(len(prompts)):
        rt.drop_session(f"b{i}")
    print(f"largest batched-vs-solo logit difference: {worst:.4f}")
    assert worst < 2.0
