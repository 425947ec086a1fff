"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when a kernel is defined, so on a machine without CUDA it must be
set before any test module imports ``crescent.kernels``: here, before collection starts.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
