"""``--device``, ``--dtype`` and ``--kv-cache-dtype`` on ``crescent up`` and ``crescent profile``:
what reaches every native engine role (prefill, decode, aggregated), and what is refused before
anything starts or loads, with a message naming the setting (services/cli.py, services/launcher.py
``check_engine_settings``). In-process (typer's runner) with the platform stood in, except the last
test, which runs ``crescent up --device cuda`` as an operator would on this GPU-less machine."""

from __future__ import annotations

import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from crescent.services import cli, launcher
from crescent.services.engine import device as device_mod
from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.settings import EngineSettings
from crescent.services.launcher import PlatformPlan
from crescent.services.profile import ProfilePlan
from tests.engine.tiny_model import TINY, tiny_weights

runner = CliRunner()


class RecordingPlatform:
    """Stands in for launcher.Platform: records the plan, starts nothing, fails at the wait."""

    plans: list[PlatformPlan] = []
    stop_requested = False

    def __init__(self, plan: PlatformPlan, run_dir: Path) -> None:
        RecordingPlatform.plans.append(plan)

    def request_stop(self) -> None: ...

    def start(self) -> None: ...

    def wait_ready(self, timeout_s: float, on_ready) -> None:  # noqa: ANN001
        raise launcher.LaunchError("stood in: nothing started")

    def stop(self) -> None: ...


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> type[RecordingPlatform]:
    RecordingPlatform.plans = []
    monkeypatch.setattr(launcher, "Platform", RecordingPlatform)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # leave pytest's own handlers alone
    return RecordingPlatform


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees ``count`` CUDA devices (0 here anyway; also on a machine with a GPU)."""
    monkeypatch.setattr(device_mod, "cuda_device_count", lambda: count)


def engines(plan: PlatformPlan) -> dict[str, dict]:
    return {spec.name: spec.config["engine"] for spec in plan.services() if "engine" in spec.config}


def test_the_options_offer_exactly_the_settings_values() -> None:
    fields = EngineSettings.model_fields
    assert {d.value for d in cli.EngineDtype} == set(typing.get_args(fields["dtype"].annotation))
    assert {d.value for d in cli.KvCacheDtype} == set(typing.get_args(fields["kv_cache_dtype"].annotation))


def test_up_device_cuda_without_a_gpu_is_refused_before_anything_starts(
        platform: type[RecordingPlatform], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus(monkeypatch, 0)
    run_dir = tmp_path / "run"
    for args in (["--device", "cuda"], ["--device", "cuda:0", "--aggregated", "1"]):
        result = runner.invoke(cli.app, ["up", "--run-dir", str(run_dir), *args])
        assert result.exit_code == 2, result.output
        assert "crescent up: engine.device" in result.output and "no CUDA device is available" in result.output
    assert platform.plans == [] and not run_dir.exists()  # no platform, no configs, no certificates
    gpus(monkeypatch, 1)
    result = runner.invoke(cli.app, ["up", "--run-dir", str(run_dir), "--device", "cuda:1"])
    assert result.exit_code == 2 and "engine.device 'cuda:1': this process sees 1 CUDA device(s)" in result.output
    result = runner.invoke(cli.app, ["up", "--run-dir", str(run_dir), "--device", "gpu"])
    assert result.exit_code == 2 and "engine.device 'gpu': use 'cpu', 'cuda' or 'cuda:N'" in result.output
    assert platform.plans == []


def test_up_hands_device_dtype_and_kv_cache_dtype_to_the_aggregated_engines(
        platform: type[RecordingPlatform], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus(monkeypatch, 1)
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path), "--aggregated", "2", "--device", "cuda",
                                     "--dtype", "bfloat16", "--kv-cache-dtype", "float32"])
    assert result.exit_code == 1 and "stood in" in result.output  # past every check, to the (stood-in) start
    (plan,) = platform.plans
    got = engines(plan)
    assert sorted(got) == ["aggregated-0", "aggregated-1"]
    for engine in got.values():
        assert (engine["device"], engine["dtype"], engine["kv_cache_dtype"]) == ("cuda", "bfloat16", "float32")
        assert EngineSettings(**engine).kv_cache_dtype == "float32"  # what each engine's settings load


def test_up_kv_cache_dtype(platform: type[RecordingPlatform], tmp_path: Path) -> None:
    """Passed to the pools; fp8 only for a model with MLA latents (kimi_k3), said before anything
    starts; refused with vLLM (its own settings); a dtype outside the settings' values refused by typer."""
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path), "--kv-cache-dtype", "bfloat16"])
    assert result.exit_code == 1, result.output
    assert [e["kv_cache_dtype"] for e in engines(platform.plans[-1]).values()] == ["bfloat16", "bfloat16"]
    assert all("device" not in e and "dtype" not in e for e in engines(platform.plans[-1]).values())
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path), "--model", "kimi-k3-nano",
                                     "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 1, result.output
    assert {e["kv_cache_dtype"] for e in engines(platform.plans[-1]).values()} == {"fp8"}
    started = len(platform.plans)
    gguf = tmp_path / "llama.gguf"
    gguf.write_bytes(b"")  # a Llama-family model by its name: nothing reads it before the check
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run"), "--model", str(gguf),
                                     "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 2 and "engine.kv_cache_dtype 'fp8' (--kv-cache-dtype)" in result.output
    assert "is a gguf model" in " ".join(result.output.split())  # the console wraps long lines
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run"), "--engine", "vllm",
                                     "--kv-cache-dtype", "bfloat16"])
    assert result.exit_code == 2 and "--kv-cache-dtype bfloat16: these set the native engine" in result.output
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run"), "--kv-cache-dtype", "int8"])
    assert result.exit_code == 2 and "kv-cache-dtype" in result.output
    assert len(platform.plans) == started and not (tmp_path / "run").exists()


def test_up_refuses_what_the_engine_settings_refuse(platform: type[RecordingPlatform], tmp_path: Path) -> None:
    """EngineSettings is the judge (here of the block size), before anything starts."""
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run"), "--block-size", "8192"])
    assert result.exit_code == 2 and "crescent up: engine.block_size: " in result.output and "4096" in result.output
    assert platform.plans == [] and not (tmp_path / "run").exists()


def test_up_refuses_a_block_size_the_cuda_kernels_cannot_take_before_anything_starts(
        platform: type[RecordingPlatform], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On CUDA a Llama-family engine refuses a block size that is not a multiple of 16 at start
    (and would restart into the refusal); crescent up says it once. kimi_k3 takes any size."""
    from crescent.services.engine import attention

    gpus(monkeypatch, 1)
    monkeypatch.setattr(attention, "triton_paged_attention", lambda: object())  # as where Triton imports
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run"), "--device", "cuda", "--block-size", "24"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "engine.block_size 24 (--block-size) on engine.device 'cuda'" in said and "multiple of 16" in said
    assert platform.plans == [] and not (tmp_path / "run").exists()
    for args in (["--block-size", "48"], ["--model", "kimi-k3-nano", "--block-size", "24"]):
        result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path / "ok"), "--device", "cuda", *args])
        assert result.exit_code == 1 and "stood in" in result.output, result.output  # past every check


# ---- crescent profile ---------------------------------------------------------------------------

TINY_PLAN = ProfilePlan(prefill=((32, 0), (96, 0), (160, 0), (160, 64), (160, 128)),
                        decode=((1, 40), (2, 100), (4, 40), (4, 120)), decode_steps=1)  # as few as the fits take


def test_profile_builds_its_engine_from_the_options_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    import crescent.services.instance.runtime as runtime
    import crescent.services.profile as profile

    built: list[EngineSettings] = []

    def tiny_engine(settings: EngineSettings, *, progress: bool) -> Engine:
        built.append(settings)
        model = LlamaModel(TINY, tiny_weights(), device=settings.device, dtype=getattr(torch, settings.dtype))
        return Engine(model, model_id="tiny", kv_capacity_tokens=settings.kv_capacity_tokens,
                      block_size=settings.block_size, kv_cache_dtype=getattr(torch, settings.kv_cache_dtype))

    monkeypatch.setattr(runtime, "build_engine", tiny_engine)
    monkeypatch.setattr(profile, "QUICK_PLAN", TINY_PLAN)
    out = tmp_path / "costs.yaml"
    result = runner.invoke(cli.app, ["profile", "--quick", "--mode", "pools", "--threads", "1", "--block-size", "16",
                                     "--out", str(out),
                                     "--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype", "float32"])
    assert result.exit_code == 0, result.output
    (settings,) = built
    assert (settings.device, settings.dtype, settings.kv_cache_dtype) == ("cpu", "bfloat16", "float32")
    assert "device cpu, dtype bfloat16, KV cache float32" in out.read_text().splitlines()[0]


def test_profile_refuses_what_the_engine_would_before_loading(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus(monkeypatch, 0)
    result = runner.invoke(cli.app, ["profile", "--quick", "--device", "cuda"])
    assert result.exit_code == 2 and "crescent profile: engine.device 'cuda': no CUDA device" in result.output
    assert "loading" not in result.output
    gguf = tmp_path / "llama.gguf"
    gguf.write_bytes(b"")  # refused before the loader would find it empty
    result = runner.invoke(cli.app, ["profile", "--quick", "--model", str(gguf), "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 2 and "engine.kv_cache_dtype 'fp8'" in result.output
    result = runner.invoke(cli.app, ["profile", "--quick", "--dtype", "float64"])
    assert result.exit_code == 2 and "dtype" in result.output


# ---- as an operator runs it ------------------------------------------------------------------------


@pytest.mark.slow  # starts the crescent command
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_up_device_cuda_on_this_gpu_less_machine_exits_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "crescent.services.cli", "up", "--device", "cuda",
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    said = " ".join(done.stderr.split())
    assert "crescent up: engine.device 'cuda': no CUDA device is available to this process" in said
    assert "set engine.device: cpu" in said and "Starting Crescent" not in said
    assert not run_dir.exists()  # nothing was started or written
    assert took < 60, f"took {took:.0f} s"  # the import of torch and typer, no model load or service start
