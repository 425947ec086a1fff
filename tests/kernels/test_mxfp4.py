"""MXFP4: encoding facts from the OCP spec, quantisation error, kernel vs reference."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.mxfp4 import (
    E2M1_VALUES,
    E8M0_NAN,
    dequantize_mxfp4,
    e8m0_to_float,
    mxfp4_matmul,
    mxfp4_matmul_reference,
    quantize_mxfp4,
)
from tests.kernels.helpers import rel_rms


def test_known_encoding():
    # block amax 6 -> scale 2^(2 - 2) = 1 -> E8M0 byte 127; values are exact E2M1 codes
    w = torch.zeros(32)
    w[:4] = torch.tensor([0.5, -6.0, 1.5, 3.0])
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [127]
    assert blocks[0, :2].tolist() == [0x1 | (0xF << 4), 0x3 | (0x5 << 4)]  # low nibble first
    assert blocks[0, 2:].eq(0).all()


def test_representable_values_round_trip_exactly():
    codes = torch.randint(0, 16, (8, 64))
    codes[:, 0] = 7  # amax 6 in every block -> scale exactly 2^(e - 2) below
    codes[:, 32] = 7
    exps = torch.randint(-10, 10, (8, 2)).float()
    w = E2M1_VALUES[codes] * torch.exp2(exps).repeat_interleave(32, dim=1)
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)


def test_rounding_is_nearest_with_ties_to_even_and_saturates():
    w = torch.zeros(32)
    w[:6] = torch.tensor([6.0, 0.75, 2.5, 5.0, 0.2, 1.2])  # amax 6 keeps scale 1
    blocks, scales = quantize_mxfp4(w)
    got = dequantize_mxfp4(blocks, scales)[:6]
    assert got.tolist() == [6.0, 1.0, 2.0, 4.0, 0.0, 1.0]  # 0.75->1, 2.5->2, 5->4: even mantissa
    w[0] = 7.5  # same scale (floor(log2 7.5) = 2), beyond the largest element: saturate
    assert dequantize_mxfp4(*quantize_mxfp4(w))[0].item() == 6.0


def test_quantisation_error_is_bounded_by_the_block_scale():
    w = torch.randn(16, 128) * torch.logspace(-3, 3, 16)[:, None]
    blocks, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(blocks, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)  # unit at exponent 0
    # rounding errs by <= 1 unit (the 4 -> 6 gap); the spec's scale lets a block's amax reach
    # just under 8 units, which saturates to 6: < 2 units
    assert ((back - w).abs() < step * 2.0).all()
    assert rel_rms(back, w) < 0.15


@pytest.mark.parametrize("m,n,k", [(5, 40, 64), (33, 16, 96)])
def test_kernel_matches_reference(m, n, k, device, nan_outputs):
    blocks, scales = quantize_mxfp4(torch.randn(n, k))
    x = torch.randn(m, k)
    out = mxfp4_matmul(x.to(device), blocks.to(device), scales.to(device))
    assert torch.isfinite(out).all()
    assert rel_rms(out, mxfp4_matmul_reference(x, blocks, scales)) < 1e-5


def test_e8m0_byte_ff_is_nan_not_inf(device, nan_outputs):
    # OCP MX spec v1.0, E8M0: 0xFF encodes NaN; 0x00..0xFE are 2^-127..2^127 (no inf, no zero)
    factors = e8m0_to_float(torch.tensor([0x00, 0x7F, 0xFE, 0xFF], dtype=torch.uint8))
    assert factors[:3].tolist() == [2.0**-127, 1.0, 2.0**127] and factors[3].isnan()
    blocks, scales = quantize_mxfp4(torch.ones(2, 64))
    scales[1, 0] = E8M0_NAN
    w = dequantize_mxfp4(blocks, scales)
    assert w[1, :32].isnan().all()
    assert torch.equal(w[1, 32:], torch.ones(32))  # the other block of that row is untouched
    assert torch.equal(w[0], torch.ones(64))
    out = mxfp4_matmul(torch.ones(2, 64, device=device), blocks.to(device), scales.to(device)).cpu()
    assert out[:, 1].isnan().all()  # the kernel decodes the byte the same way
    assert torch.equal(out[:, 0], torch.full((2,), 64.0))


def test_bad_inputs_raise_value_error():
    blocks, scales = quantize_mxfp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="blocks of 32"):
        mxfp4_matmul(torch.randn(2, 32), blocks, scales)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_matmul(torch.randn(2, 64), blocks, scales.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 40))
