"""The Llama model's linear layers and norms on any device and dtype.

On the CPU in float32 the engine keeps ``InvariantLinear`` (oneDNN, batch-invariant and the
bit-exact reference) and the reference ``rms_norm`` as they are. Elsewhere:

- ``DeviceLinear`` is ``F.linear`` in the weight's dtype on its device. On this CPU in bf16 it is
  batch-invariant (tests/engine/test_device.py checks it); on CUDA cuBLAS picks kernels by the
  batch's row count, so rows may differ in the last bits between batch sizes until a
  batch-invariant CUDA matmul (issue 30, item 3) takes its place here. Unverified on a GPU.
- ``norm`` computes RMSNorm in float32 and rounds the result to the activations' dtype, as
  Hugging Face's Llama does, so a bf16 model's norms do not lose the mean of squares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crescent.kernels.reference import InvariantLinear, rms_norm


class DeviceLinear:
    """``x @ weight.T`` for 2-D ``x`` in the weight's dtype on its device."""

    __slots__ = ("weight", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def make_linear(weight: torch.Tensor) -> InvariantLinear | DeviceLinear:
    """The batch-invariant oneDNN layer for a float32 CPU weight (today's path), else ``DeviceLinear``."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return InvariantLinear(weight)
    return DeviceLinear(weight)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; ``weight`` float32. In float32 exactly the reference op; else computed in float32."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return rms_norm(x.float(), weight, eps).to(x.dtype)
