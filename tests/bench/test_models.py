"""Where the benchmark scripts cut a model into stages, for any depth."""

from __future__ import annotations

import argparse

import pytest

from skippyd.bench.models import add_model_option, layer_bounds, model_keys, model_path


def test_the_cuts_of_smollm2_are_the_measured_ones_and_scale_with_depth():
    assert layer_bounds(30, 2) == (0, 17, 30)
    assert layer_bounds(30, 3) == (0, 11, 22, 30)
    assert layer_bounds(22, 2) == (0, 12, 22)
    assert layer_bounds(32, 3) == (0, 12, 23, 32)


@pytest.mark.parametrize(("n_layer", "stages"), [(1, 2), (2, 3), (30, 4)])
def test_a_chain_that_cannot_be_cut_is_refused(n_layer, stages):
    with pytest.raises(ValueError):
        layer_bounds(n_layer, stages)


def test_the_model_option_defaults_to_the_embedded_model(tmp_path, smollm2_path):
    parser = argparse.ArgumentParser()
    add_model_option(parser)
    assert model_path(parser.parse_args([])) == smollm2_path
    assert model_keys(parser.parse_args([])) == {}
    chosen = parser.parse_args(["--model", str(tmp_path / "m.gguf")])
    assert model_path(chosen) == tmp_path / "m.gguf"
    assert model_keys(chosen) == {"model_path": str(tmp_path / "m.gguf")}
