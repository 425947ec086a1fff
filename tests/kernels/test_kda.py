"""KDA: references against each other and fla-core, kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.kda import (
    chunk_kda,
    chunk_kda_reference,
    chunk_kda_with_snapshots,
    fused_recurrent_kda,
    kda_decode,
    kda_gate,
    l2_normalize,
    recurrent_kda_reference,
)
from tests.kernels.helpers import rel_rms

TOL = 1e-4  # fp32 throughout; holds on a GPU with IEEE fp32 dots as well


def make_inputs(b, t, h, hv, dk, dv, device="cpu", with_state=True):
    q = torch.randn(b, t, h, dk, device=device)
    k = torch.randn(b, t, h, dk, device=device)
    v = torch.randn(b, t, hv, dv, device=device)
    # the K3 gate: strong decays (down to -5 per token) exercise the chunk's range handling
    g = kda_gate(torch.randn(b, t, hv, dk) * 2, torch.randn(hv) * 0.5, torch.randn(hv * dk)).to(device)
    beta = torch.rand(b, t, hv, device=device)
    h0 = torch.randn(b, hv, dk, dv, device=device) if with_state else None
    return q, k, v, g, beta, h0


def test_two_references_agree_on_varlen_with_initial_state():
    q, k, v, g, beta, _ = make_inputs(1, 45, 2, 4, 16, 16)
    cu = torch.tensor([0, 7, 7, 40, 45])
    h0 = torch.randn(4, 4, 16, 16)
    o1, s1 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    o2, s2 = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert rel_rms(o2, o1) < 1e-5
    assert rel_rms(s2, s1) < 1e-5
    assert torch.equal(s1[1], h0[1])  # an empty sequence keeps its state


def test_reference_matches_fla_core_naive_kda():
    naive = pytest.importorskip("fla.ops.kda.naive")
    gate = pytest.importorskip("fla.ops.kda.gate")
    q, k, v, _, beta, h0 = make_inputs(2, 33, 2, 4, 16, 32)
    f, a_log, dt_bias = torch.randn(2, 33, 4, 16), torch.randn(4), torch.randn(4 * 16)
    g = kda_gate(f, a_log, dt_bias, lower_bound=-5.0)
    g_fla = gate.naive_kda_lowerbound_gate(g=f, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert rel_rms(g, g_fla) < 1e-6
    o, s = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0)
    o_fla, s_fla = naive.naive_recurrent_kda(
        q=l2_normalize(q), k=l2_normalize(k), v=v, g=g, beta=beta,
        initial_state=h0, output_final_state=True,
    )
    assert rel_rms(o, o_fla) < 1e-5
    assert rel_rms(s, s_fla) < 1e-5


@pytest.mark.parametrize("kernel", [chunk_kda, fused_recurrent_kda])
@pytest.mark.parametrize("shape", [(2, 37, 2, 2, 16, 32), (1, 50, 1, 2, 32, 16)])
def test_kernel_matches_reference(kernel, shape, device, nan_outputs):
    q, k, v, g, beta, h0 = make_inputs(*shape, device=device)
    o, s = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0.cpu())
    assert o.shape == v.shape and o.dtype == v.dtype
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o, o_ref) < TOL
    assert rel_rms(s, s_ref) < TOL


@pytest.mark.parametrize("kernel", [chunk_kda, fused_recurrent_kda])
def test_varlen_equals_per_sequence_loop(kernel, device, nan_outputs):
    lens = [5, 0, 23, 16, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 4, 16, 16, device=device)
    h0 = torch.randn(len(lens), 4, 16, 16, device=device)
    o, s = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            assert torch.equal(s[i], h0[i])
            continue
        oi, si = kernel(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
            initial_state=h0[i : i + 1], output_final_state=True,
        )
        assert rel_rms(o[:, a:b], oi) < 1e-6
        assert rel_rms(s[i], si[0]) < 1e-6


def test_snapshots_are_the_states_at_every_block_boundary(device, nan_outputs):
    lens, every = [40, 0, 32, 15, 70], 32
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 1, 2, 16, 16, device=device)
    h0 = torch.randn(len(lens), 2, 16, 16, device=device)
    res = chunk_kda_with_snapshots(q, k, v, g, beta, every=every, initial_state=h0, cu_seqlens=cu)
    assert res.snapshot_offsets.tolist() == [0, 1, 1, 2, 2, 4]
    plain_o, plain_s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(res.o, plain_o) and torch.equal(res.final_state, plain_s)
    for i, start in enumerate(cu[:-1].tolist()):
        for j in range(lens[i] // every):
            end = start + (j + 1) * every
            sl = slice(start, end)
            _, s_ref = recurrent_kda_reference(
                q[:, sl].cpu(), k[:, sl].cpu(), v[:, sl].cpu(), g[:, sl].cpu(), beta[:, sl].cpu(),
                initial_state=h0[i : i + 1].cpu(),
            )
            assert rel_rms(res.snapshots[res.snapshot_offsets[i] + j], s_ref[0]) < TOL
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_kda_with_snapshots(q, k, v, g, beta, every=24, cu_seqlens=cu)


def test_chunked_prefill_then_decode_equals_one_long_run(device):
    q, k, v, g, beta, _ = make_inputs(2, 40, 2, 4, 16, 16, device=device, with_state=False)
    n_prefill = 29
    o_ref, s_ref = recurrent_kda_reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu())
    # prefill in two pieces, the second resuming from the first's final state
    o_a, s = chunk_kda(q[:, :13], k[:, :13], v[:, :13], g[:, :13], beta[:, :13], output_final_state=True)
    sl = slice(13, n_prefill)
    o_b, s = chunk_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s, output_final_state=True)
    outs = [o_a, o_b]
    for t in range(n_prefill, 40):
        outs.append(kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s).unsqueeze(1))
    assert rel_rms(torch.cat(outs, 1), o_ref) < TOL
    assert rel_rms(s, s_ref) < TOL


def test_decode_uses_state_slots_and_leaves_others_alone(device):
    q, k, v, g, beta, _ = make_inputs(3, 1, 1, 2, 16, 16, device=device, with_state=False)
    pool = torch.randn(6, 2, 16, 16, device=device)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2], device=device)
    o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool, state_indices=slots)
    o_ref, s_ref = recurrent_kda_reference(q, k, v, g, beta, initial_state=before[slots].cpu())
    assert rel_rms(o, o_ref[:, 0]) < TOL
    assert rel_rms(pool[slots], s_ref) < TOL
    untouched = torch.tensor([1, 3, 5], device=device)
    assert torch.equal(pool[untouched], before[untouched])


def test_bad_inputs_raise_value_error_before_launch(device):
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 4, 16, 16, device=device)
    with pytest.raises(ValueError, match="g must have shape"):
        chunk_kda(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="multiple of"):
        chunk_kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda(q[..., :12], k[..., :12], v, g[..., :12], beta)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 3, 8], device=device))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=h0.double())
    with pytest.raises(ValueError, match="state"):
        kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], torch.zeros(1, 4, 16, 8, device=device))
