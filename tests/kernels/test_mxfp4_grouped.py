"""The grouped MXFP4 matmul (kimi_k3's packed experts on the Triton path) against per-expert
dequantize-then-matmul, including empty experts and a NaN scale."""

from __future__ import annotations

import torch

from crescent.kernels.mxfp4 import Mxfp4Tensor
from crescent.kernels.mxfp4.grouped import grouped_mxfp4_matmul
from tests.kernels.helpers import rel_rms


def _reference(x: torch.Tensor, w: Mxfp4Tensor, offsets: list[int]) -> torch.Tensor:
    dense = w.dequantize()
    return torch.cat([x[a:b] @ dense[e].T for e, (a, b) in enumerate(zip(offsets, offsets[1:]))])


def test_grouped_mxfp4_matches_per_expert_dequantized(device, nan_outputs) -> None:
    w = Mxfp4Tensor.quantize(torch.randn(5, 48, 64) / 8)
    offsets = [0, 17, 17, 20, 37, 40]  # expert 1 gets no rows, expert 0 more than one tile
    x = torch.randn(offsets[-1], 64)
    got = grouped_mxfp4_matmul(x.to(device), w.blocks.to(device), w.scales.to(device),
                               torch.tensor(offsets, device=device))
    assert rel_rms(got.cpu(), _reference(x, w, offsets)) < 1e-5


def test_a_nan_scale_poisons_only_its_experts_rows(device) -> None:
    w = Mxfp4Tensor.quantize(torch.randn(2, 32, 32))
    w.scales[1, 3, 0] = 0xFF  # E8M0 NaN in expert 1, output column 3
    offsets = [0, 4, 9]
    out = grouped_mxfp4_matmul(torch.randn(9, 32).to(device), w.blocks.to(device), w.scales.to(device),
                               torch.tensor(offsets, device=device)).cpu()
    assert out[4:, 3].isnan().all() and not out[:4].isnan().any() and not out[4:, :3].isnan().any()
