"""scripts/gpu_model_checks.py, the model sections of scripts/gpu_check.sh, on the CPU: the line
format a person reads, the refusals, and (slow, ~2-3 min here) the K3 check through the Triton
interpreter inside gpu_check.sh --device cpu."""

from __future__ import annotations

import importlib.util
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
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode")


def load_script():
    """scripts/gpu_model_checks.py as a module (scripts/ is no package), run in this process."""
    spec = importlib.util.spec_from_file_location("gpu_model_checks", CHECKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a real prefill and decode process with SmolLM2: ~10 s here
def test_the_handoff_check_compares_the_decode_stream_with_one_process(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "models.jsonl"
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "handoff", "--device", "cpu", "--json", str(out)])
    assert load_script().main() == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["check"] == "handoff" and line["status"] == "PASS" and line["tokens_equal"] == "16/16"
    assert json.loads(out.read_text()) == line


@pytest.mark.slow  # the same processes, one streamed token changed
def test_a_decode_stream_that_differs_from_one_process_fails_the_handoff_check(monkeypatch, capsys) -> None:  # noqa: ANN001
    script = load_script()
    real = script._disaggregated

    def one_token_off(engine, tokens, tmp, **kw):  # noqa: ANN001, ANN003 - what a wrong handoff would stream
        got = real(engine, tokens, tmp, **kw)
        return got[:9] + [got[9] + 1] + got[10:]

    monkeypatch.setattr(script, "_disaggregated", one_token_off)
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "handoff", "--device", "cpu"])
    assert script.main() == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["status"] == "FAIL" and "from token 9" in line["reason"] and line["tokens_equal"] == "15/16"


def test_cuda_without_a_gpu_and_unknown_checks_are_refused(monkeypatch, capsys) -> None:  # noqa: ANN001
    script = load_script()
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "k3", "--device", "cuda"])
    assert script.main() == 1 and "no CUDA device" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "flash", "--device", "cpu"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2 and "unknown checks" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_cpu_mode_runs_the_k3_check_and_summarises_it(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CRESCENT_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_STAGES": "models", "GPU_MODEL_CHECKS": "k3", "GPU_CHECK_BUDGET_S": "400"}
    proc = subprocess.run(["bash", str(GPU_CHECK), "--device", "cpu"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=420)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "PASS  models" in summary and "model PASS k3" in summary and "rel_err fp32 packed mxfp4" in summary


@pytest.fixture
def one_thread():
    """One torch thread (the script keeps at most the caller's): two OpenMP threads on this loaded
    2-core machine made a 49152-wide masked_fill 30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_sampling_entry_times_host_logits_and_the_sampler_in_cpu_mode(monkeypatch, capsys, one_thread) -> None:  # noqa: ANN001
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "sampling", "--device", "cpu"])
    assert load_script().main() == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["check"] == "sampling" and line["status"] == "PASS" and line["rows"] == "16x49152 bf16 on cpu"
    assert 0 < line["host_logits_ms"] and 0 < line["greedy_ms"] < line["sampled_ms"]


def test_a_host_row_that_is_not_the_device_rows_widening_fails_the_sampling_entry(monkeypatch, capsys, one_thread) -> None:  # noqa: ANN001
    import crescent.services.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "host_logits", lambda logits: logits.float().cpu() * 1.001)
    monkeypatch.setattr(sys, "argv", ["gpu_model_checks.py", "sampling", "--device", "cpu"])
    assert load_script().main() == 1
    assert "exact float32 widening" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reason"]
