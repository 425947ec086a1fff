"""Shared helpers for the Triton kernels: interpreter detection and input checks."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels launch on CUDA, or on CPU only under the interpreter."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"tensor on {t.device} needs CUDA (or TRITON_INTERPRET=1 for CPU tests)"
            )


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_pow2(name: str, n: int, lo: int = 16, hi: int = 256) -> None:
    if n < lo or n > hi or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two in [{lo}, {hi}]")


def alloc(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer. Every wrapper allocates through this one function so tests
    can swap in NaN-filled buffers and catch elements a kernel forgot to write."""
    return torch.empty(shape, dtype=dtype, device=device)


def row_tile_offsets(group_offsets: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Where each expert's row tiles start in a grouped matmul's grid (``[E + 1]``, int32), from
    the experts' row ranges ``group_offsets``; built on the device, so no host read sizes the grid."""
    sizes = group_offsets[1:] - group_offsets[:-1]
    offsets = torch.zeros(group_offsets.shape[0], dtype=torch.int32, device=group_offsets.device)
    offsets[1:] = ((sizes + block_rows - 1) // block_rows).cumsum(0)
    return offsets
