"""GGUF tensor data → float32 arrays, and the Q/K row order fix for llama.cpp checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType, quants

from crescent.services.engine.loader.errors import ModelLoadError, UnsupportedTensorTypeError

SUPPORTED_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1}
)


def dequantize(name: str, data: np.ndarray, qtype: GGMLQuantizationType, shape: Sequence[int]) -> np.ndarray:
    """Dequantize one tensor's raw GGUF data to float32 with the given (row-major) ``shape``.

    ``data`` is what ``GGUFReader`` exposes: typed values for F32/F16, raw block bytes otherwise.
    """
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedTensorTypeError(
            f"tensor {name!r} is stored as {qtype.name}; this loader dequantizes only {supported}"
        )
    values = quants.dequantize(data, qtype)
    expected = int(np.prod(shape))
    if values.size != expected:
        raise ModelLoadError(f"tensor {name!r} holds {values.size} values, its shape {tuple(shape)} needs {expected}")
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(tuple(shape))
    # F32 data comes back as a view of the read-only file map: own the memory instead.
    return values if values.flags.writeable else values.copy()


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of Q or K rows (``num_heads`` = KV heads for K).

    llama.cpp stores each head's rows interleaved as (pair, 2) for its GPT-J style RoPE;
    Hugging Face's rotate-half RoPE wants the two halves of each head contiguous.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return np.ascontiguousarray(
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
