"""The KDA layer's reference pieces: short convolution with a conv state, gated output norm."""

from __future__ import annotations

import torch

from crescent.kernels.kda import gated_rms_norm, kda_gate, short_conv


def test_short_conv_decode_steps_continue_a_prefill_exactly():
    x = torch.randn(2, 12, 8)
    w = torch.randn(8, 4)
    y_full, _ = short_conv(x, w)
    y_pre, state = short_conv(x[:, :7], w)
    steps = []
    for t in range(7, 12):
        y_t, state = short_conv(x[:, t : t + 1], w, state)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat([y_pre, *steps], 1), y_full)


def test_short_conv_is_causal_and_depthwise():
    x = torch.randn(1, 10, 3)
    w = torch.randn(3, 4)
    y, _ = short_conv(x, w)
    x2 = x.clone()
    x2[:, 6:, :] += 1.0  # change the future ...
    x2[:, :, 1] += 1.0  # ... and another channel
    y2, _ = short_conv(x2, w)
    torch.testing.assert_close(y2[:, :6, 0], y[:, :6, 0])
    # token 0 sees only itself (zero history): silu(w[:, -1] * x_0)
    torch.testing.assert_close(y[0, 0], torch.nn.functional.silu(w[:, -1] * x[0, 0]))


def test_gated_rms_norm_scales_to_unit_rms_and_gates():
    x = torch.randn(4, 16) * 7
    weight = torch.ones(16)
    open_gate = torch.full((4, 16), 30.0)
    y = gated_rms_norm(x, open_gate, weight)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), rtol=1e-4, atol=1e-4)
    closed = gated_rms_norm(x, torch.full((4, 16), -30.0), weight)
    assert closed.abs().max() < 1e-10


def test_k3_gate_is_bounded_by_lower_bound():
    g = kda_gate(torch.randn(100, 2, 8) * 50, torch.randn(2), torch.randn(16), lower_bound=-5.0)
    assert g.min() >= -5.0 and g.max() <= 0.0
