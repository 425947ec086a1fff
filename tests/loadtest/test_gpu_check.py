"""The GPU check's plumbing, on the CPU: ``loadtest/bench_gpu_kernels.py --dry-run`` (Triton's
interpreter, tiny fp32 shapes) and ``scripts/gpu_check.sh``'s stages, budget, summary and exit code.

No figure is measured here; what is checked is what a person running the script on a GPU relies on:
one JSON line with every kernel's row, a wrong kernel caught by its check, a clear refusal without
CUDA, and a non-zero exit with a summary naming the failed stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loadtest import bench_gpu_kernels
from loadtest.gpu_peaks import peaks_for

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "loadtest" / "bench_gpu_kernels.py"
CHECK = ROOT / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dry run")


def cpu_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CRESCENT_PYTHON": sys.executable, **extra}


def test_peak_table_matches_the_longest_device_name():
    assert peaks_for("NVIDIA H200") == (989.0, 4800.0)
    assert peaks_for("NVIDIA H100 80GB HBM3") == (989.0, 3350.0)
    assert peaks_for("NVIDIA H100 PCIe") == (756.0, 2000.0)  # not the SXM part's figures
    assert peaks_for("Some Future Accelerator") is None


@pytest.mark.slow
def test_dry_run_prints_one_json_line_with_every_kernel_checked(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    assert result["dry_run"] and result["ok"] and result["complete"] and result["device"] == "cpu-interpreter"
    assert result["peak_bf16_tflops"] is None and result["kda_prefill_ge_fla"] is None  # nothing measured
    assert "fp32 reference" in result["kda_compared_with"]  # says what KDA was compared with
    for kernel in ("kda", "mla", "moe", "mxfp4"):
        assert len(result[kernel]) == 2
        for row in result[kernel]:
            assert row["ok"] and row["rel_rms_vs_check"] < 1e-4 and row["ms"] > 0
            assert {"tflops", "gbs", "frac_peak_tflops", "frac_peak_gbs"} <= row.keys()


def test_a_wrong_kernel_fails_its_check(monkeypatch, capsys):
    import crescent.kernels.mxfp4 as mxfp4

    real = mxfp4.mxfp4_matmul
    monkeypatch.setattr(mxfp4, "mxfp4_matmul", lambda x, b, s: real(x, b, s) * 1.1)  # 10% off
    assert bench_gpu_kernels.main(["--dry-run", "--only", "mxfp4"]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not result["ok"] and not any(row["ok"] for row in result["mxfp4"])
    assert all(row["rel_rms_vs_check"] > 0.05 for row in result["mxfp4"])


@pytest.mark.slow
def test_without_cuda_and_without_dry_run_it_refuses_plainly():
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    proc = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--only", "kda,flash"],
                          capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert proc.returncode == 2 and "flash" in proc.stderr


def test_check_script_parses():
    subprocess.run(["bash", "-n", str(CHECK)], check=True)


def run_check(tmp_path: Path, *args: str, **env: str) -> tuple[int, str, str]:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, cwd=tmp_path,
                          env=cpu_env(OUT=str(out), **env), timeout=300)
    return proc.returncode, proc.stdout, (out / "summary.txt").read_text()


@pytest.mark.slow  # runs every stage of the check script: 13 s in make test-fast
def test_check_dry_run_passes_its_stages_and_writes_the_figures(tmp_path):
    rc, stdout, summary = run_check(tmp_path, "--dry-run", GPU_CHECK_STAGES="preflight,env,bench")
    assert rc == 0, stdout
    for stage in ("preflight", "env", "bench"):
        assert f"PASS  {stage}" in summary
    assert "kernel_tests" not in summary and "all stages passed" in summary
    assert json.loads((tmp_path / "out" / "bench_gpu_kernels.json").read_text())["ok"]
    assert "every module imports" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_check_without_a_gpu_fails_and_says_which_stage(tmp_path):
    rc, _, summary = run_check(tmp_path, GPU_CHECK_STAGES="preflight")
    assert rc == 1
    assert "FAIL  preflight" in summary and "SOME STAGES FAILED" in summary


def test_check_stops_starting_stages_when_the_budget_is_spent(tmp_path):
    rc, _, summary = run_check(tmp_path, "--dry-run", GPU_CHECK_STAGES="bench", GPU_CHECK_BUDGET_S="5")
    assert rc == 1 and "FAIL  bench: not started" in summary


def test_the_wheelhouse_carries_the_async_test_plugin_at_this_venvs_version():
    """The GPU image has pytest and pytest-timeout but not pytest-asyncio, without which every async
    kvstore/prefill device test of the kernel_tests stage fails there; the env stage imports it."""
    from importlib.metadata import version

    pins = dict(line.split("==") for line in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["pytest-asyncio"] == version("pytest-asyncio")
    assert '"pytest_asyncio"' in CHECK.read_text()


@pytest.mark.slow  # collects the listed files (imports the engine and kvstore tests): ~5 s here
def test_every_device_test_the_kernel_tests_stage_names_exists():
    """The stage names device tests by node id; a renamed test would make pytest exit 4 on the GPU."""
    import re

    body = CHECK.read_text().split("stage_kernel_tests() {", 1)[1].split("\n}\n", 1)[0]
    ids = re.findall(r'(tests/[\w/]+\.py::[\w\-\[\]]+)', body)
    assert any("test_device.py" in i for i in ids) and any("test_device_staging.py" in i for i in ids)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          capture_output=True, text=True, cwd=ROOT, env=cpu_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(ids)} test" in proc.stdout.splitlines()[-1]


def test_cuda_n_narrows_every_stage_to_that_gpu_or_is_refused(tmp_path):
    rc, stdout, _ = run_check(tmp_path, "--device", "cuda:1", GPU_CHECK_STAGES="preflight")
    assert rc == 1 and "CUDA_VISIBLE_DEVICES=1" in stdout.splitlines()[0]  # no GPU here: preflight fails
    rc, stdout, _ = run_check(tmp_path, "--device", "cuda:1", GPU_CHECK_STAGES="preflight", CUDA_VISIBLE_DEVICES="4,6")
    assert "CUDA_VISIBLE_DEVICES=6" in stdout.splitlines()[0]  # the second of the GPUs this shell may use
    for bad, env in (("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"}), ("cuda:x", {})):
        proc = subprocess.run(["bash", str(CHECK), "--device", bad], capture_output=True, text=True, cwd=tmp_path,
                              env=cpu_env(OUT=str(tmp_path / "refused"), **env), timeout=60)
        assert proc.returncode == 2 and "cuda:" in proc.stderr


def test_the_serving_smoke_puts_the_engines_on_the_device_it_tests():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_serving_smoke", ROOT / "scripts" / "gpu_serving_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    cmd = smoke.up_command("kimi-k3-nano", 8000, Path("/tmp/run"), "cuda")
    assert cmd[cmd.index("--device") + 1] == "cuda"
    body = CHECK.read_text().split("stage_smoke() {", 1)[1].split("\n}\n", 1)[0]
    assert "--tier \"$tier\" --device \"$device\"" in body and "device=cuda" in body
    assert "no device setting" not in smoke.__doc__
