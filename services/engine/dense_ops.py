"""The Llama model's linear layers and norms on any device and dtype.

- CPU, float32: ``InvariantLinear`` (oneDNN, batch-invariant, the bit-exact reference) and the
  plain ``rms_norm``, as before devices existed.
- CUDA, any dtype: the same ``InvariantLinear``/``rms_norm`` of ``crescent.kernels.cpu``, which
  send CUDA tensors to the batch-invariant Triton kernels (``kernels/batch_invariant``, fp32
  accumulation, the weight kept in its dtype). Which tensors count as CUDA is decided by
  ``crescent.kernels.cpu.ops._on_gpu`` alone, so a test that patches it runs this whole path on
  the CPU under the Triton interpreter (tests/engine/test_cuda_code_path.py). Unverified on a GPU
  here (no GPU was lent).
- CPU in bf16/fp16 (and ``meta``, the tests' stand-in for a device): ``DeviceLinear``, ``F.linear``
  in the weight's dtype; on this CPU it is batch-invariant in bf16 (tests/engine/test_device.py
  checks it), and ``norm`` computes in float32 and rounds to the activations' dtype, as
  Hugging Face's Llama does, so a bf16 model's norms keep the mean of squares exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crescent.kernels.cpu import InvariantLinear, rms_norm
from crescent.kernels.cpu import ops as cpu_ops  # its ``_on_gpu``: the one seam tests patch to run the CUDA path


class DeviceLinear:
    """``x @ weight.T`` for 2-D ``x`` in the weight's dtype on its device."""

    __slots__ = ("weight", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def make_linear(weight: torch.Tensor) -> InvariantLinear | DeviceLinear:
    """The batch-invariant layer where one exists for the weight (CPU float32, CUDA), else ``DeviceLinear``."""
    if cpu_ops._on_gpu(weight) or (weight.device.type == "cpu" and weight.dtype == torch.float32):
        return InvariantLinear(weight)
    return DeviceLinear(weight)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a float32 ``weight``: the kernel's on CUDA (fp32 accumulation, x's dtype out),
    exactly the reference op in float32, else computed in float32 and rounded to x's dtype."""
    if x.dtype == torch.float32 or cpu_ops._on_gpu(x):
        return rms_norm(x, weight, eps)
    return rms_norm(x.float(), weight, eps).to(x.dtype)
