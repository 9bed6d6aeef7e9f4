"""GPU offload settings reach llama.cpp's model parameters.

These machines have no GPU, so what is checked is the hand-over: the real loader is
called with the parameters the settings ask for (observed by wrapping it), the model
loads and runs on the CPU, and the daemon reports what it asked and what it got.
"""

from __future__ import annotations

import logging

import pytest
from llama_cpp import llama_cpp as L

from skippyd.config import parse_config
from skippyd.daemon.assembly import runtime_options
from skippyd.engine.runtime import llama as llama_module
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions, model_params, offload_facts


@pytest.fixture
def loads(monkeypatch):
    """Every llama_model_params the real loader is called with, read at the call."""
    seen: list[dict] = []
    real = L.llama_model_load_from_file

    def spy(path, params):
        split = [params.tensor_split[i] for i in range(int(L.llama_max_devices()))] \
            if params.tensor_split else []
        seen.append({"n_gpu_layers": params.n_gpu_layers, "main_gpu": params.main_gpu,
                     "tensor_split": split})
        return real(path, params)

    monkeypatch.setattr(llama_module.L, "llama_model_load_from_file", spy)
    return seen


def test_the_offload_settings_reach_the_loader_and_the_model_still_runs(loads, tiny_model_path):
    options = RuntimeOptions(str(tiny_model_path), lane_count=1, ctx_size=256, n_batch=64,
                             n_ubatch=64, threads=1, gpu_layers=-1, main_gpu=1,
                             tensor_split=(3.0, 1.0))
    with LlamaRuntime(options) as runtime:
        assert runtime.offload == {"gpu_layers": -1, "main_gpu": 1, "tensor_split": [3.0, 1.0],
                                   "gpu_backend": bool(L.llama_supports_gpu_offload())}
    (seen,) = loads
    assert (seen["n_gpu_layers"], seen["main_gpu"]) == (-1, 1)
    assert seen["tensor_split"][:2] == [3.0, 1.0]
    assert set(seen["tensor_split"][2:]) <= {0.0}


def test_the_default_keeps_every_layer_on_the_cpu(loads, tiny_model_path):
    with LlamaRuntime(RuntimeOptions(str(tiny_model_path), lane_count=1, ctx_size=256,
                                     n_batch=64, n_ubatch=64, threads=1)):
        pass
    assert loads == [{"n_gpu_layers": 0, "main_gpu": 0, "tensor_split": []}]


def test_the_config_keys_become_runtime_options(tiny_model_path):
    config = parse_config({"runtime": {"gpu_layers": 12, "main_gpu": 2, "tensor_split": "1,1,2"}})
    options = runtime_options(config, tiny_model_path)
    assert (options.gpu_layers, options.main_gpu, options.tensor_split) == (12, 2, (1.0, 1.0, 2.0))
    params = model_params(options).struct
    assert (params.n_gpu_layers, params.main_gpu) == (12, 2)
    assert [params.tensor_split[i] for i in range(3)] == [1.0, 1.0, 2.0]


def test_bad_offload_options_are_refused(tiny_model_path):
    with pytest.raises(ValueError, match="gpu_layers"):
        RuntimeOptions(str(tiny_model_path), gpu_layers=-2).validate()
    with pytest.raises(ValueError, match="tensor_split"):
        RuntimeOptions(str(tiny_model_path), tensor_split=(1.0,) * 17).validate()


def test_a_cpu_only_build_says_the_model_stays_on_the_cpu(caplog, tiny_model_path):
    from skippyd.daemon.assembly import StageEngine

    if L.llama_supports_gpu_offload():
        pytest.skip("this llama.cpp build has a GPU backend")
    config = parse_config({"stage": {"model_path": str(tiny_model_path)},
                           "runtime": {"gpu_layers": -1, "ctx_size": 256, "threads": 1}})
    engine = StageEngine(config)
    assert engine.offload == offload_facts(runtime_options(config, tiny_model_path))
    with caplog.at_level(logging.WARNING, logger="skippyd.daemon.assembly"):
        engine.load()
    try:
        assert engine.describe()["offload"]["gpu_backend"] is False
        assert any("no GPU backend: the model runs on the CPU" in r.getMessage()
                   for r in caplog.records)
    finally:
        engine.close()
