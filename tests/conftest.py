"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when a kernel is defined, so on a machine without CUDA it must be
set before any test module imports ``crescent.kernels``: here, before collection starts.
"""

import os

import pytest
import torch

from tests import process_guard

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    # `slow` on every test that starts a process (the plugin refuses one under -m "not slow").
    if not config.pluginmanager.has_plugin(process_guard.__name__):
        config.pluginmanager.register(process_guard, process_guard.__name__)
