"""MoE: grouped matmul kernel, routing determinism, quantile balancing, full layer vs reference."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.moe import (
    expert_load,
    grouped_matmul,
    moe_forward,
    moe_reference,
    quantile_balance_offsets,
    route,
    router_scores,
)
from tests.kernels.helpers import rel_rms


def test_grouped_matmul_matches_per_expert_matmul(device, nan_outputs):
    sizes = [5, 0, 17, 1, 33]
    w = torch.randn(len(sizes), 40, 24, device=device)
    x = torch.randn(sum(sizes), 40, device=device)
    offs = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], device=device)
    out = grouped_matmul(x, w, offs)
    expected = torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(offs[:-1], offs[1:]))])
    assert torch.isfinite(out).all()
    assert rel_rms(out, expected) < 1e-5


def skewed_scores(t: int, e: int) -> torch.Tensor:
    # experts differ in mean and spread, as a trained router's do
    logits = torch.randn(t, e) * torch.linspace(0.5, 2.0, e) + torch.linspace(-2.0, 2.0, e)
    return torch.sigmoid(logits)


def test_quantile_offsets_equalise_load_on_skewed_scores():
    e, k = 16, 2
    calib, fresh = skewed_scores(20000, e), skewed_scores(20000, e)
    _, ids_plain = route(fresh, torch.zeros(e), k)
    plain = expert_load(ids_plain, e).float()
    offsets = quantile_balance_offsets(calib, k)
    _, ids_bal = route(fresh, offsets, k)
    balanced = expert_load(ids_bal, e).float()
    ideal = fresh.shape[0] * k / e
    assert plain.max() / ideal > 3  # without offsets a few experts take most tokens
    assert plain.min() / ideal < 0.01
    assert (balanced / ideal - 1).abs().max() < 0.1  # each expert within 10% of its share
    assert abs(offsets.mean().item()) < 1e-6


def test_quantile_offsets_reject_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        quantile_balance_offsets(torch.rand(100, 4), 4)
    with pytest.raises(ValueError, match="calibration"):
        quantile_balance_offsets(torch.rand(3, 4), 1)


def test_routing_of_a_token_does_not_depend_on_its_batch():
    x = torch.randn(64, 32)
    w_r = torch.randn(8, 32)
    offsets = torch.randn(8) * 0.1
    weights_all, ids_all = route(router_scores(x, w_r), offsets, 2)
    sub = torch.tensor([9, 3, 40])
    weights_sub, ids_sub = route(router_scores(x[sub], w_r), offsets, 2)
    assert torch.equal(ids_sub, ids_all[sub])
    torch.testing.assert_close(weights_sub, weights_all[sub], rtol=0, atol=1e-6)


def make_moe(device, e=6, d=32, f=16, s=1):
    return dict(
        router_weight=torch.randn(e, d, device=device) * 0.3,
        offsets=torch.randn(e, device=device) * 0.05,
        w_gate_up=torch.randn(e, d, 2 * f, device=device) * 0.2,
        w_down=torch.randn(e, f, d, device=device) * 0.2,
        shared_gate_up=torch.randn(s, d, 2 * f, device=device) * 0.2,
        shared_down=torch.randn(s, f, d, device=device) * 0.2,
    )


def test_moe_layer_matches_reference_and_reports_load(device, nan_outputs):
    p = make_moe(device)
    x = torch.randn(20, 32, device=device)
    out, load = moe_forward(x, top_k=2, routed_scale=2.5, **p)
    ref = moe_reference(x.cpu(), top_k=2, routed_scale=2.5, **{n: t.cpu() for n, t in p.items()})
    assert rel_rms(out, ref) < 1e-5
    assert load.sum().item() == 20 * 2


def test_moe_output_of_a_token_does_not_depend_on_its_batch(device):
    p = make_moe(device)
    x = torch.randn(24, 32, device=device)
    full, _ = moe_forward(x, top_k=2, **p)
    alone, _ = moe_forward(x[5:6], top_k=2, **p)
    other = torch.cat([torch.randn(7, 32, device=device), x[5:6]])
    mixed, _ = moe_forward(other, top_k=2, **p)
    torch.testing.assert_close(alone[0], full[5], rtol=0, atol=1e-6)
    torch.testing.assert_close(mixed[-1], full[5], rtol=0, atol=1e-6)
