"""``InvariantLinear``: a row's result does not depend on the rows around it, and it is a linear.

Disaggregated serving promises the tokens of a single-process run whatever a request is batched
with (kernels/cpu/ops.py says why MKL's sgemm breaks that); this holds it to the promise on
the active backend, for the default model's projection shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crescent.kernels.cpu import InvariantLinear

SHAPES = [(576, 1728), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # SmolLM2-135M: qkv, o, gate_up, down, head


@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_each_row_is_the_same_whatever_the_batch(in_features: int, out_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    x = torch.randn(40, in_features, generator=gen)
    linear = InvariantLinear(weight)
    alone = torch.cat([linear(x[i: i + 1]) for i in range(8)])
    for rows in (2, 3, 5, 8, 13, 16, 33, 40):
        n = min(rows, 8)
        assert torch.equal(linear(x[:rows])[:n], alone[:n]), f"rows differ in a batch of {rows}"
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
