"""Batch-invariant linear and RMSNorm (Triton): a row's bits do not depend on its batch.

The engine's promise (a request's tokens do not depend on what it is batched with) rests on
every row-wise op giving the same bits for a row alone and in a batch. On CUDA these kernels
carry it (``kernels/cpu/ops.py`` sends CUDA tensors here); here they run in Triton's
interpreter, so the checks are: the same row bitwise in batches of 1, 3, 8, 17 and across
M tiles (70 rows > BLOCK_M = 64), values within fp32 rounding of a float64 oracle (bf16: within
bf16 rounding), strided inputs, and the dispatch in ``crescent.kernels.cpu.ops``.
"""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.batch_invariant import (
    invariant_linear,
    invariant_rms_norm,
    linear_reference,
    rms_norm_reference,
)
from crescent.kernels.cpu import ops as cpu_ops
from tests.kernels.helpers import rel_rms

pytestmark = pytest.mark.usefixtures("nan_outputs")
BATCHES = (1, 3, 8, 17)
FP32_TOL = 1e-6
BF16_TOL = 1e-2  # one bf16 rounding of the output (2^-8 relative), on every element


def each_row_alone_equals_batched(fn, x: torch.Tensor) -> None:
    # rows at tile edges (0, 2, 16, 63, 64, the last), each launched alone: one launch per row is
    # what makes this slow in the interpreter, so not every row
    picked = sorted({i for i in (0, 1, 2, 7, 16, 63, 64, x.shape[0] - 1) if i < x.shape[0]})
    alone = {i: fn(x[i : i + 1])[0] for i in picked}
    for rows in BATCHES + (x.shape[0],):
        batched = fn(x[:rows])
        for i in (i for i in picked if i < rows):
            assert torch.equal(batched[i], alone[i]), f"row {i} changed in a batch of {rows}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_the_same_bits_in_every_batch(device, dtype):
    # K = 100: three full BLOCK_K steps and a masked tail; N = 72: two column tiles, the last partial
    w = (torch.randn(72, 100) / 10).to(device, dtype)
    b = torch.randn(72).to(device, dtype)
    x = torch.randn(70, 100).to(device, dtype)  # 70 rows: row 64 on lies in the second M tile
    each_row_alone_equals_batched(lambda rows: invariant_linear(rows, w, b), x)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_float64_oracle(device, dtype, tol, with_bias):
    w = (torch.randn(80, 200) / 14).to(device, dtype)
    x = torch.randn(9, 200).to(device, dtype)
    b = torch.randn(80).to(device, dtype) if with_bias else None
    out = invariant_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (9, 80)
    assert rel_rms(out, linear_reference(x, w, b)) < tol


def test_linear_takes_strided_inputs_and_leading_dims(device):
    big = torch.randn(6, 2, 130, device=device)
    x = big[:, 1, 3:127]              # a [6, 124] view: row stride 260, not contiguous
    w_t = torch.randn(124, 40, device=device)
    w = w_t.t()                       # [40, 124] with column stride 40
    assert not x.is_contiguous() and not w.is_contiguous()
    assert rel_rms(invariant_linear(x, w), linear_reference(x, w)) < FP32_TOL
    x3 = torch.randn(2, 5, 124, device=device)
    out = invariant_linear(x3, w)
    assert out.shape == (2, 5, 40)
    assert torch.equal(out.reshape(10, 40), invariant_linear(x3.reshape(10, 124), w))


def test_linear_refuses_bad_input_before_launch(device):
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="same K"):
        invariant_linear(torch.randn(2, 15, device=device), w)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(torch.randn(2, 16, device=device, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias"):
        invariant_linear(torch.randn(2, 16, device=device), w, torch.randn(7, device=device))


@pytest.mark.parametrize("dim", [576, 1500])  # SmolLM2's hidden size; 1500 streams in two chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_the_same_bits_in_every_batch(device, dim, dtype):
    weight = (1 + torch.randn(dim) / 5).to(device)
    x = (torch.randn(17, dim) * 3).to(device, dtype)
    each_row_alone_equals_batched(lambda rows: invariant_rms_norm(rows, weight, 1e-5), x)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_rms_norm_matches_the_float64_oracle(device, dtype, tol):
    weight = (1 + torch.randn(1500) / 5).to(device)
    x = (torch.randn(2, 3, 1500) * 3).to(device, dtype)
    out = invariant_rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_rms(out, rms_norm_reference(x, weight, 1e-5)) < tol


def test_cpu_ops_send_gpu_tensors_to_the_triton_kernels(device, monkeypatch):
    """What the engine calls (``InvariantLinear``, ``batch_invariant_linear``, ``rms_norm``) takes
    the Triton path for a tensor that ``_on_gpu`` claims, keeping the weight's dtype: here CPU
    tensors are claimed, so the interpreter stands in for the GPU."""
    monkeypatch.setattr(cpu_ops, "_on_gpu", lambda t: True)
    w = (torch.randn(48, 64) / 8).to(device, torch.bfloat16)
    linear = cpu_ops.InvariantLinear(w)
    assert linear.weight.dtype == torch.bfloat16
    x = torch.randn(5, 64).to(device, torch.bfloat16)
    assert torch.equal(linear(x), invariant_linear(x, w))
    assert torch.equal(cpu_ops.batch_invariant_linear(x, w), invariant_linear(x, w))
    norm_w = torch.randn(64, device=device)
    assert torch.equal(cpu_ops.rms_norm(x, norm_w, 1e-5), invariant_rms_norm(x, norm_w, 1e-5))
    each_row_alone_equals_batched(linear, torch.randn(17, 64).to(device, torch.bfloat16))
