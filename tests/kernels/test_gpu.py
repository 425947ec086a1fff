"""GPU-only checks: K3-sized shapes, bf16 inputs, and fla-core's compiled KDA kernels.

Skipped without CUDA (fla's kernels autotune, which needs a GPU driver; bf16 is wrong in the
Triton interpreter). Tolerances are looser than the fp32 tests because outputs are bf16.
"""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.batch_invariant import invariant_linear, invariant_rms_norm, linear_reference
from crescent.kernels.kda import chunk_kda, kda_decode, kda_gate, recurrent_kda_reference
from crescent.kernels.mxfp4 import mxfp4_matmul, mxfp4_matmul_reference, quantize_mxfp4
from crescent.kernels.paged import paged_attention_reference, paged_decode_attention, paged_prefill_attention
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_linear_and_rms_norm_on_the_gpu(dtype):
    """The property the interpreter cannot prove for real MMA units: a row's bits in a batch of
    1 equal those in batches of 3, 8, 17 and 256, at SmolLM2's and a Llama-8B-sized projection."""
    for n, k in ((1728, 576), (4096, 4096)):
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
        x = torch.randn(256, k, device="cuda").to(dtype)
        alone = torch.cat([invariant_linear(x[i : i + 1], w) for i in range(17)])
        for rows in (3, 8, 17, 256):
            assert torch.equal(invariant_linear(x[:rows], w)[: min(rows, 17)], alone[: min(rows, 17)]), rows
        tol = 1e-5 if dtype == torch.float32 else BF16_TOL
        assert rel_rms(invariant_linear(x, w), linear_reference(x, w)) < tol
        norm_w = torch.randn(k, device="cuda")
        alone = torch.cat([invariant_rms_norm(x[i : i + 1], norm_w, 1e-5) for i in range(17)])
        assert torch.equal(invariant_rms_norm(x, norm_w, 1e-5)[:17], alone)


@pytest.mark.parametrize("heads,kv,dim", [(9, 3, 64), (32, 8, 128)])
def test_paged_attention_bf16_pool_on_the_gpu(heads, kv, dim):
    """Decode and varlen prefill over a strided bf16 pool of 64-token pages at serving sizes."""
    page, layers = 64, 2
    lengths, new = [1, 63, 64, 65, 1500, 2048], [1, 63, 1, 65, 300, 1]
    pages_per_seq = [-(-n // page) for n in lengths]
    pool = torch.randn(sum(pages_per_seq), layers, 2, page, kv, dim, device="cuda").bfloat16()
    perm = torch.randperm(pool.shape[0], device="cuda")
    tables = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for i, p in enumerate(pages_per_seq):
        tables[i, :p] = perm[used : used + p]
        used += p
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    lens = torch.tensor(lengths, device="cuda")
    scale = dim**-0.5
    q = torch.randn(len(lengths), heads, dim, device="cuda").bfloat16()
    decode = paged_decode_attention(q, k, v, tables, lens, scale=scale)
    cu = torch.arange(len(lengths) + 1, device="cuda")
    assert rel_rms(decode, paged_attention_reference(q, k, v, tables, lens, cu, scale=scale)) < BF16_TOL
    alone = paged_decode_attention(q[4:5], k, v, tables[4:5], lens[4:5], scale=scale)
    assert torch.equal(alone[0], decode[4])
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device="cuda")
    qp = torch.randn(sum(new), heads, dim, device="cuda").bfloat16()
    prefill = paged_prefill_attention(qp, k, v, tables, lens, cu, scale=scale)
    assert rel_rms(prefill, paged_attention_reference(qp, k, v, tables, lens, cu, scale=scale)) < BF16_TOL


def test_grouped_mxfp4_bf16_at_k3_latent_width():
    """kimi_k3's packed experts on CUDA: 8 experts, K3's latent width 3584 in, bf16 activations."""
    from crescent.kernels.mxfp4 import Mxfp4Tensor
    from crescent.kernels.mxfp4.grouped import grouped_mxfp4_matmul

    w = Mxfp4Tensor.quantize(torch.randn(8, 512, 3584) / 60)
    offsets = [0, 40, 40, 97, 130, 200, 201, 256, 300]
    x = torch.randn(offsets[-1], 3584)
    out = grouped_mxfp4_matmul(x.cuda().bfloat16(), w.blocks.cuda(), w.scales.cuda(), torch.tensor(offsets).cuda())
    dense = w.dequantize()
    want = torch.cat([x[a:b].bfloat16().float() @ dense[e].T for e, (a, b) in enumerate(zip(offsets, offsets[1:]))])
    assert rel_rms(out.float().cpu(), want) < BF16_TOL


def test_mla_reads_an_fp8_latent_cache_as_its_dequantized_values():
    """The fp8 latent cache (engine.kv_cache_dtype fp8): the kernel's fp8 loads give what the same
    cache widened to fp32 gives (fp32 queries: no tf32 in either)."""
    from crescent.kernels.mla import mla_paged_attention

    cache = torch.randn(12, 64, 576, device="cuda").to(torch.float8_e4m3fn)
    q_lat, q_rope = torch.randn(3, 16, 512, device="cuda"), torch.randn(3, 16, 64, device="cuda")
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [11, 0, 0, 0]], device="cuda")
    seq_lens, cu_q = torch.tensor([200, 100, 30], device="cuda"), torch.tensor([0, 1, 2, 3], device="cuda")
    got = mla_paged_attention(q_lat, q_rope, cache, table, seq_lens, cu_q, scale=0.07)
    want = mla_paged_attention(q_lat, q_rope, cache.float(), table, seq_lens, cu_q, scale=0.07)
    assert rel_rms(got, want) < 1e-5
