"""Kernel tests run on CUDA when present, else in Triton's CPU interpreter in fp32.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), hence at import time here, before the test modules are collected.
"""

import os
import sys

import torch

_KERNEL_PACKAGES = ("kda", "mla", "moe", "mxfp4", "attnres", "batch_invariant", "paged")

if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1" and any(
        m.split(".")[2] in _KERNEL_PACKAGES for m in sys.modules if m.startswith("crescent.kernels.")
    ):
        # defined as compiled kernels already: they would fail obscurely on CPU tensors
        raise RuntimeError(
            "crescent.kernels was imported before TRITON_INTERPRET=1 was set; set it in the "
            "environment or in the root tests/conftest.py when CUDA is absent"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.helpers import nan_outputs  # noqa: E402,F401  (fixture re-export)

torch.set_num_threads(2)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed_and_gpu_marker(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
