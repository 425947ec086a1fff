"""Shared helpers for the kernel tests."""

from __future__ import annotations

import pytest
import torch

from crescent.kernels import _triton


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / ||expected||_rms: the error measure of every kernel test."""
    a, e = actual.double().cpu(), expected.double().cpu()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@pytest.fixture
def nan_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every kernel output buffer start NaN-filled, so unwritten elements show up."""

    def nan_alloc(shape, *, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_triton, "alloc", nan_alloc)
