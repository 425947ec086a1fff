"""Kernel tests run on CUDA when present, else in Triton's CPU interpreter in fp32.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), hence at import time here, before the test modules are collected.
"""

import os

import torch

if not torch.cuda.is_available():
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
