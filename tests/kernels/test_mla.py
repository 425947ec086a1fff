"""Gated MLA: absorbed paged-cache kernel against the non-absorbed reference."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.mla import (
    absorb_query,
    apply_output_gate,
    expand_output,
    mla_attention_reference,
    mla_paged_attention,
    write_latent_cache,
)
from tests.kernels.helpers import rel_rms

H, DN, DR, DC, DV, PAGE = 3, 16, 16, 32, 16, 16
SCALE = (DN + DR) ** -0.5


def make_weights():
    return torch.randn(H, DC, DN) * 0.3, torch.randn(H, DC, DV) * 0.3


def paged_cache(lengths, device):
    """A NaN-filled cache (unwritten slots must never be read) with shuffled page order."""
    pages_per_seq = [-(-n // PAGE) for n in lengths]
    total = sum(pages_per_seq) + 2
    cache = torch.full((total, PAGE, DC + DR), float("nan"), device=device)
    perm = torch.randperm(total)
    table = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for i, p in enumerate(pages_per_seq):
        table[i, :p] = perm[used : used + p]
        used += p
    return cache, table.to(device)


@pytest.mark.parametrize("cached,new", [([0, 0], [5, 20]), ([17, 31, 0], [1, 1, 1]), ([20], [13])])
def test_kernel_matches_non_absorbed_reference(cached, new, device, nan_outputs):
    """Full prefill, decode (one query per sequence), and a prefill chunk on a cached prefix."""
    w_uk, w_uv = make_weights()
    lengths = [c + n for c, n in zip(cached, new)]
    cache, table = paged_cache(lengths, device)
    seqs = []
    for i, total in enumerate(lengths):
        c_kv, k_rope = torch.randn(total, DC), torch.randn(total, DR)
        write_latent_cache(cache, table, i, 0, c_kv.to(device), k_rope.to(device))
        q_nope, q_rope = torch.randn(new[i], H, DN), torch.randn(new[i], H, DR)
        seqs.append((c_kv, k_rope, q_nope, q_rope))
    q_lat = torch.cat([absorb_query(s[2], w_uk) for s in seqs]).to(device)
    q_rope = torch.cat([s[3] for s in seqs]).to(device)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=device)
    o_lat = mla_paged_attention(
        q_lat, q_rope, cache, table, torch.tensor(lengths, device=device), cu_q, scale=SCALE
    )
    assert torch.isfinite(o_lat).all()
    o = expand_output(o_lat.cpu(), w_uv)
    ref = torch.cat([mla_attention_reference(s[2], s[3], s[0], s[1], w_uk, w_uv, SCALE) for s in seqs])
    assert rel_rms(o, ref) < 1e-5


def test_output_gate_scales_each_head():
    o = torch.randn(4, H, DV)
    gate = torch.tensor([-40.0, 0.0, 40.0]).expand(4, H)
    gated = apply_output_gate(o, gate)
    assert gated[:, 0].abs().max() < 1e-12
    torch.testing.assert_close(gated[:, 1], o[:, 1] / 2)
    torch.testing.assert_close(gated[:, 2], o[:, 2])


def test_bad_inputs_raise_value_error():
    cache = torch.zeros(4, PAGE, DC + DR)
    table = torch.zeros(1, 4, dtype=torch.int32)
    q_lat, q_rope = torch.randn(1, H, DC), torch.randn(1, H, DR)
    lens, cu = torch.tensor([3]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="Dc \\+ Dr"):
        mla_paged_attention(q_lat, torch.randn(1, H, 8), cache, table, lens, cu, scale=1.0)
    with pytest.raises(ValueError, match="cu_q"):
        mla_paged_attention(q_lat, q_rope, cache, table, lens, torch.tensor([0, 1, 2]), scale=1.0)
    with pytest.raises(ValueError, match="int32/int64"):
        mla_paged_attention(q_lat, q_rope, cache, table.float(), lens, cu, scale=1.0)
