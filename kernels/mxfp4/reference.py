"""OCP Microscaling MXFP4: E2M1 elements in blocks of 32 sharing one E8M0 scale.

Checkpoint layout (as in gpt-oss-style ``*_blocks`` / ``*_scales`` tensors), for a weight
``W [..., N, K]`` with K a multiple of 32:

    blocks  uint8 [..., N, K/32, 16]   two E2M1 codes per byte, low nibble = even element
    scales  uint8 [..., N, K/32]       E8M0: the block's factor is 2^(scale - 127); 0xFF is NaN

E2M1 code (4 bits): sign | exponent (2 bits, bias 1) | mantissa (1 bit), giving magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. Quantisation follows the OCP MX spec: shared exponent
floor(log2(amax)) - 2 (2 = E2M1's largest exponent), elements rounded to nearest, ties to
even, saturating at 6.
"""

from __future__ import annotations

import torch

BLOCK = 32
E8M0_NAN = 0xFF  # the OCP MX spec's only special E8M0 value: the whole block decodes to NaN
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[..., K]`` (K % 32 == 0) -> (blocks uint8 ``[..., K/32, 16]``, scales uint8 ``[..., K/32]``)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got {w.shape[-1]}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = (x / torch.exp2(exp)[..., None]).abs()
    idx = torch.searchsorted(_MIDPOINTS, scaled.contiguous())  # count of midpoints below |x|
    tie = (idx < 7) & (scaled == _MIDPOINTS[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ties go to the even mantissa
    codes = (idx | ((x < 0).long() << 3)).to(torch.uint8)
    codes = torch.where(idx == 0, torch.zeros_like(codes), codes)  # no negative zero
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 factors 2^(s - 127); the byte 0xFF is NaN (2^128 would be +inf)."""
    factor = torch.exp2(scales.float() - 127)
    return torch.where(scales == E8M0_NAN, torch.full_like(factor, float("nan")), factor)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks ``[..., nb, 16]``, scales ``[..., nb]``) -> fp32 ``[..., nb * 32]``."""
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    vals = E2M1_VALUES[codes] * e8m0_to_float(scales)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def mxfp4_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` @ W^T with W ``[N, K]`` given as MXFP4 -> fp32 ``[M, N]``."""
    return x.float() @ dequantize_mxfp4(blocks, scales).t()
