"""Which model a benchmark script runs, and where a split pipeline cuts it.

Every script under ``bench/`` takes ``--model PATH`` (the embedded model by default),
so each figure can be taken on a synthesized real-size shape as well
(``skippyd model synth``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from skippyd.config.defaults import default_model_path
from skippyd.model_files.model_info import inspect_model

#: Where each cut falls, as a share of the layers: the final stage also computes the
#: output head, so it gets fewer layers (17 and 11/22 of SmolLM2's 30).
CUT_SHARES = {2: (17 / 30,), 3: (11 / 30, 22 / 30)}


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF to run (default: the embedded model); e.g. one written by "
                             "`skippyd model synth --shape 1b`")


def model_path(args: argparse.Namespace) -> Path:
    """The ``--model`` of ``args``, or the embedded model."""
    return Path(args.model) if getattr(args, "model", None) else default_model_path()


def model_layers(path: Path) -> int:
    return inspect_model(path).n_layer


def layer_bounds(n_layer: int, stages: int) -> tuple[int, ...]:
    """``(0, cut, ..., n_layer)`` for a chain of ``stages`` stages."""
    if stages not in CUT_SHARES:
        raise ValueError(f"stages must be one of {sorted(CUT_SHARES)}")
    cuts = [max(1, round(n_layer * share)) for share in CUT_SHARES[stages]]
    bounds = (0, *cuts, n_layer)
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"a model of {n_layer} layers cannot be cut into {stages} stages")
    return bounds


def model_keys(args: argparse.Namespace) -> dict[str, str]:
    """The ``[stage]`` key naming ``--model``, or none for the default model."""
    return {"model_path": str(Path(args.model).resolve())} if getattr(args, "model", None) \
        else {}
