"""A weight kept packed in MXFP4 in memory: 4-bit codes two per byte plus one E8M0 scale per 32.

``Mxfp4Tensor`` stands where a float weight ``W [..., N, K]`` would (``shape``, indexing the
leading dimensions, ``.to(device)``), but holds only ``blocks uint8 [..., N, K/32, 16]`` and
``scales uint8 [..., N, K/32]``: 17 bytes per 32 weights, 4.25 bits per weight resident instead
of 32 for fp32. Whoever multiplies by it decides how: the Triton ``mxfp4_matmul`` decodes blocks
in registers; a CPU reference dequantizes one 2-D weight (one expert) for the call and drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from crescent.kernels.mxfp4.reference import BLOCK, dequantize_mxfp4, quantize_mxfp4


@dataclass(frozen=True, slots=True)
class Mxfp4Tensor:
    blocks: torch.Tensor  # uint8 [..., N, K/32, 16], low nibble = even element
    scales: torch.Tensor  # uint8 [..., N, K/32], E8M0

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales must be uint8, got {self.blocks.dtype}, {self.scales.dtype}")
        if self.blocks.dim() < 3 or self.blocks.shape[-1] != BLOCK // 2 or self.blocks.shape[:-1] != self.scales.shape:
            raise ValueError(f"MXFP4 blocks [..., N, K/32, 16] and scales [..., N, K/32] disagree: "
                             f"{tuple(self.blocks.shape)}, {tuple(self.scales.shape)}")

    @staticmethod
    def quantize(w: torch.Tensor) -> Mxfp4Tensor:
        """Pack a float weight ``[..., N, K]`` (K a multiple of 32) per the OCP MX spec."""
        return Mxfp4Tensor(*quantize_mxfp4(w))

    @staticmethod
    def stack(parts: Sequence[Mxfp4Tensor]) -> Mxfp4Tensor:
        """``torch.stack`` of packed weights along a new leading dimension (experts)."""
        return Mxfp4Tensor(torch.stack([p.blocks for p in parts]), torch.stack([p.scales for p in parts]))

    @staticmethod
    def cat_rows(parts: Sequence[Mxfp4Tensor]) -> Mxfp4Tensor:
        """Concatenate along N (output rows), e.g. a gate and an up projection into gate_up."""
        return Mxfp4Tensor(torch.cat([p.blocks for p in parts], dim=-3), torch.cat([p.scales for p in parts], dim=-2))

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[..., N, K]`` of the weight it stands for."""
        return torch.Size((*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK))

    def dim(self) -> int:
        return self.scales.dim()

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        """Bytes resident in memory (codes and scales)."""
        return self.blocks.numel() * self.blocks.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index: int) -> Mxfp4Tensor:
        """One slice of the leading dimension (an expert), still packed."""
        if self.dim() < 3:
            raise IndexError("index a stacked MXFP4 weight [E, N, K]; a 2-D weight has no experts")
        return Mxfp4Tensor(self.blocks[index], self.scales[index])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Mxfp4Tensor:
        """Move the packed bytes; a float ``dtype`` is the compute dtype and leaves them packed."""
        if device is None:
            return self
        return Mxfp4Tensor(self.blocks.to(device), self.scales.to(device))

    def contiguous(self) -> Mxfp4Tensor:
        return Mxfp4Tensor(self.blocks.contiguous(), self.scales.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[..., N, K]``; the E8M0 byte 0xFF gives NaN."""
        return dequantize_mxfp4(self.blocks, self.scales)
