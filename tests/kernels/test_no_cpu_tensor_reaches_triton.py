"""On a GPU machine the kernel tests run with TRITON_INTERPRET unset (conftest.py sets it only
without CUDA), so a test that does not take the ``device`` fixture must never hand Triton a tensor:
its tensors are on the CPU and Triton's device check raises there (scripts/gpu_check.sh's
kernel_tests stage would fail on its first GPU run). This reproduces that setting on the CPU: every
kernel test that does not take ``device`` runs in a subprocess with TRITON_INTERPRET=0, where any
CPU tensor reaching a kernel wrapper raises "needs CUDA"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# deselects the tests that take the `device` fixture (those run on CUDA on a GPU machine)
PLUGIN = '''
def pytest_collection_modifyitems(config, items):
    on_device = [i for i in items if "device" in getattr(i, "fixturenames", ())]
    config.hook.pytest_deselected(items=on_device)
    items[:] = [i for i in items if i not in on_device]
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernel tests themselves are this check")
def test_kernel_tests_without_the_device_fixture_hand_triton_no_cpu_tensor(tmp_path):
    (tmp_path / "host_only_kernel_tests.py").write_text(PLUGIN)
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])))
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/kernels").glob("test_*.py")
                   if p.name not in ("test_gpu.py", Path(__file__).name))  # test_gpu.py: CUDA only
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "host_only_kernel_tests",
         "--basetemp", str(tmp_path / "bt")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0, (
        "kernel tests without the device fixture reached Triton with CPU tensors (they fail on a GPU "
        "machine; take `device` and put Triton's inputs there):\n" + "\n".join(failed or [result.stdout[-3000:]]))
    assert " passed" in result.stdout
