"""Block AttnRes: reference semantics and kernel vs reference."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels.attnres import block_attn_res, block_attn_res_reference
from tests.kernels.helpers import rel_rms


def test_zero_query_averages_the_sources():
    src = torch.randn(3, 5, 16)
    h, w = block_attn_res_reference(src, torch.zeros(16))
    torch.testing.assert_close(h, src.mean(0))
    torch.testing.assert_close(w, torch.full((3, 5), 1 / 3))


def test_strong_query_selects_the_aligned_source_per_token():
    d = 16
    src = torch.randn(4, 6, d) * 0.1
    src[2, :, 0] = 5.0  # source 2 points along e_0 for every token
    query = torch.zeros(d)
    query[0] = 100.0
    h, w = block_attn_res_reference(src, query)
    assert (w[2] > 0.999).all()
    torch.testing.assert_close(h, src[2], rtol=1e-3, atol=1e-3)


def test_weights_ignore_source_scale_but_output_keeps_it():
    src = torch.randn(3, 4, 32)
    query = torch.randn(32)
    _, w = block_attn_res_reference(src, query)
    _, w_scaled = block_attn_res_reference(src * 10, query)
    torch.testing.assert_close(w, w_scaled)  # keys are RMS-normalised


@pytest.mark.parametrize("n,t,d", [(1, 3, 16), (5, 7, 48), (9, 2, 1500)])
def test_kernel_matches_reference(n, t, d, device, nan_outputs):
    src = torch.randn(n, t, d) * torch.linspace(0.5, 3, n)[:, None, None]
    query, gamma = torch.randn(d), torch.rand(d) + 0.5
    out = block_attn_res(src.to(device), query.to(device), gamma.to(device))
    assert torch.isfinite(out).all()
    assert rel_rms(out, block_attn_res_reference(src, query, gamma)[0]) < 1e-5


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="N, T, D"):
        block_attn_res(torch.randn(4, 16), torch.randn(16))
    with pytest.raises(ValueError, match="query"):
        block_attn_res(torch.randn(2, 4, 16), torch.randn(8))
