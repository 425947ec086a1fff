"""scripts/gpu_model_checks.py, the model sections of scripts/gpu_check.sh, on the CPU: the line
format a person reads, the refusals, and (slow, ~2-3 min here) the K3 check through the Triton
interpreter inside gpu_check.sh --device cpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "scripts" / "gpu_model_checks.py"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode")]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKS), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_a_check_without_its_piece_says_skip_and_why(tmp_path: Path) -> None:
    out = tmp_path / "models.jsonl"
    proc = run("handoff", "--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["check"] == "handoff" and line["status"] == "SKIP" and "CPU mode" in line["reason"]
    assert json.loads(out.read_text()) == line


def test_cuda_without_a_gpu_and_unknown_checks_are_refused() -> None:
    proc = run("k3", "--device", "cuda")
    assert proc.returncode == 1 and "no CUDA device" in proc.stdout
    proc = run("flash", "--device", "cpu")
    assert proc.returncode == 2 and "unknown checks" in proc.stderr


@pytest.mark.slow
def test_gpu_check_cpu_mode_runs_the_k3_check_and_summarises_it(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CRESCENT_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_STAGES": "models", "GPU_MODEL_CHECKS": "k3", "GPU_CHECK_BUDGET_S": "400"}
    proc = subprocess.run(["bash", str(GPU_CHECK), "--device", "cpu"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=420)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "PASS  models" in summary and "model PASS k3" in summary and "rel_err fp32 packed mxfp4" in summary
