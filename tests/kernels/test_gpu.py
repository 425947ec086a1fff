"""GPU-only checks: K3-sized shapes, bf16 inputs, and fla-core's compiled KDA kernels.

Skipped without CUDA (fla's kernels autotune, which needs a GPU driver; bf16 is wrong in the
Triton interpreter). Tolerances are looser than the fp32 tests because outputs are bf16.
"""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.kda import chunk_kda, kda_decode, kda_gate, recurrent_kda_reference
from crescent.kernels.mxfp4 import mxfp4_matmul, mxfp4_matmul_reference, quantize_mxfp4
from tests.kernels.helpers import rel_rms

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2


def k3_inputs(t: int, h: int = 4, d: int = 128):
    q, k, v = (torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = kda_gate(torch.randn(1, t, h, d), torch.randn(h) * 0.5, torch.randn(h * d)).cuda()
    beta = torch.rand(1, t, h, device="cuda", dtype=torch.bfloat16)
    return q, k, v, g, beta


def test_chunk_kda_matches_fla_chunk_kda_on_k3_head_dims():
    fla = pytest.importorskip("fla.ops.kda")
    lens = [700, 1, 300, 1024]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    q, k, v, g, beta = k3_inputs(sum(lens))
    h0 = torch.randn(len(lens), 4, 128, 128, device="cuda")
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_fla, s_fla = fla.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )
    assert rel_rms(o.float(), o_fla.float()) < BF16_TOL
    assert rel_rms(s, s_fla) < BF16_TOL


def test_bf16_prefill_and_decode_track_the_fp32_reference():
    q, k, v, g, beta = k3_inputs(257)
    o_ref, s_ref = recurrent_kda_reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu())
    o, s = chunk_kda(q[:, :256], k[:, :256], v[:, :256], g[:, :256], beta[:, :256], output_final_state=True)
    o_last = kda_decode(q[:, 256], k[:, 256], v[:, 256], g[:, 256], beta[:, 256], s)
    assert rel_rms(o.float(), o_ref[:, :256]) < BF16_TOL
    assert rel_rms(o_last.float(), o_ref[:, 256]) < BF16_TOL
    assert rel_rms(s, s_ref) < BF16_TOL


def test_mxfp4_matmul_bf16_activations():
    blocks, scales = quantize_mxfp4(torch.randn(512, 1024))
    x = torch.randn(64, 1024)
    out = mxfp4_matmul(x.cuda().bfloat16(), blocks.cuda(), scales.cuda())
    assert rel_rms(out.float(), mxfp4_matmul_reference(x.bfloat16().float(), blocks, scales)) < BF16_TOL
