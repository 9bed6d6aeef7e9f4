"""Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``).

The quantizer decides each tensor's type the way ``llama-quantize`` does (a K-quant
keeps some tensors at higher precision, the output head among them), so a quantized
synthesized model has the layout of a real model quantized the usual way.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.llama_ext import ensure_backend

logger = logging.getLogger(__name__)

#: The quantizations ``skippyd model synth --quant`` offers, to llama.cpp's file types.
QUANT_TYPES: dict[str, int] = {
    "Q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": L.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
}

#: About how many bits a weight takes in each, to foresee the output's size from an f16
#: source's (16 bits a weight); a K-quant's mix of types makes it an estimate.
BITS_PER_WEIGHT: dict[str, float] = {"Q4_0": 4.5, "Q4_K_M": 4.9, "Q8_0": 8.5}


class QuantizeError(RuntimeError):
    """llama.cpp refused to quantize the model."""


def quantize_model(source: str | Path, output: str | Path, quant: str, *, threads: int) -> Path:
    """Write ``source`` quantized to ``quant`` (a key of :data:`QUANT_TYPES`) to ``output``.

    Args:
        source: An unquantized (f16/f32) GGUF.
        output: The file to write.
        quant: ``Q4_0``, ``Q4_K_M`` or ``Q8_0``.
        threads: Threads llama.cpp quantizes with.
    """
    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    ensure_backend()
    params = L.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = max(1, threads)
    status = L.llama_model_quantize(str(source).encode(), str(output).encode(),
                                    ctypes.byref(params))
    if status != 0:
        raise QuantizeError(f"llama.cpp could not quantize {source} to {quant} (status {status})")
    return Path(output)
