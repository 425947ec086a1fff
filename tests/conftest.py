"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when a kernel is defined, so on a machine without CUDA it must be
set before any test module imports ``crescent.kernels``: here, before collection starts.

Under pytest-xdist (``make test-fast`` and ``make test``'s first two runs) each worker picks
ports from its own slice (``CRESCENT_PORT_RANGE``, inherited by every process it starts), so two
workers' servers never pick the same port.
"""

import os

import pytest
import torch

from crescent.services.common.ports import PORT_RANGE_ENV, worker_port_range
from tests import process_guard

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
if _WORKER.startswith("gw"):
    os.environ[PORT_RANGE_ENV] = worker_port_range(int(_WORKER[2:]),
                                                   int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config: pytest.Config) -> None:
    # `slow` on every test that starts a process (the plugin refuses one under -m "not slow").
    if not config.pluginmanager.has_plugin(process_guard.__name__):
        config.pluginmanager.register(process_guard, process_guard.__name__)
