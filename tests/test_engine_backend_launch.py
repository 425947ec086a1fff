"""``crescent up --engine vllm``: which Python each service runs on, what its config asks for, and
the plans that are refused before anything starts (services/launcher.py,
services/engine_vllm/interpreter.py). Nothing here starts vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from crescent.services import cli
from crescent.services import launcher
from crescent.services.engine_vllm import interpreter
from crescent.services.engine_vllm.interpreter import VllmNotInstalledError, vllm_python
from crescent.services.launcher import (
    PlanError, Platform, PlatformPlan, backend_of, child_env,
)
from tests.ports import free_port

CLI = [sys.executable, "-m", "crescent.services.cli"]
VLLM_PY = "/opt/vllm-venv/bin/python"


def vllm_plan(**kwargs) -> PlatformPlan:  # noqa: ANN003
    return PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16,
                        **{"tls": False, "cores": 2, "aggregated": 1, "backend": "vllm", **kwargs})


def test_vllm_pools_give_decode_the_kvstore_it_loads_handoffs_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "vllm_python", lambda: VLLM_PY)
    platform = Platform(vllm_plan(aggregated=0), tmp_path / "run")
    by_role = {spec.service: spec for spec in platform.specs}
    kvstore = by_role["kvstore"].grpc_address
    for role in ("prefill", "decode"):
        assert by_role[role].config["engine"]["backend"] == "vllm"
        assert by_role[role].config["kvstore_address"] == kvstore
        assert platform.command(by_role[role], tmp_path / "x.yaml")[0] == VLLM_PY
    native = Platform(PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False, cores=2),
                      tmp_path / "native")
    decode = next(spec for spec in native.specs if spec.service == "decode")
    assert "kvstore_address" not in decode.config  # the native decode takes KV in the handoff itself


def test_vllm_python_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interpreter, "repo_root", lambda: tmp_path)
    venv_python = tmp_path / ".venv-vllm" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.touch()
    found = {"vllm": SimpleNamespace(name="vllm")}
    monkeypatch.setattr(interpreter.importlib.util, "find_spec", lambda name: found.get(name))

    monkeypatch.setenv("CRESCENT_VLLM_PYTHON", VLLM_PY)  # 1. the environment wins over everything
    assert vllm_python() == VLLM_PY
    monkeypatch.delenv("CRESCENT_VLLM_PYTHON")
    assert vllm_python() == str(venv_python)  # 2. the checkout's .venv-vllm
    venv_python.unlink()
    assert vllm_python() == sys.executable  # 3. this Python, when it can import vLLM
    found.clear()
    with pytest.raises(VllmNotInstalledError, match="make install-vllm"):  # 4. none: how to install it
        vllm_python()
    monkeypatch.setenv("CRESCENT_VLLM_PYTHON", "")  # set but empty counts as unset
    with pytest.raises(VllmNotInstalledError):
        vllm_python()


@pytest.mark.slow
def test_the_interpreter_module_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys; import crescent.services.engine_vllm.interpreter as i; i.vllm_python; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_vllm_engines_run_on_the_vllm_python_and_the_rest_on_this_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRESCENT_VLLM_PYTHON", VLLM_PY)
    monkeypatch.setenv("PATH", "/usr/bin")
    platform = Platform(vllm_plan(aggregated=2), tmp_path)
    specs = {spec.name: spec for spec in platform.specs}
    assert sorted(specs) == ["aggregated-0", "aggregated-1", "gateway", "kvstore", "scheduler"]
    for name in ("aggregated-0", "aggregated-1"):
        spec = specs[name]
        assert spec.config["engine"]["backend"] == "vllm" and backend_of(spec.config) == "vllm"
        assert spec.config["engine"]["model"] == "m" and spec.config["engine"]["vllm"] == {"dtype": "float32"}
        command = platform.command(spec, tmp_path / f"{name}.yaml")
        assert command[0] == VLLM_PY
        assert command[1:] == ["-m", "crescent.services.cli", "serve", "aggregated", "--config",
                               str(tmp_path / f"{name}.yaml")]
        assert child_env(spec)["PATH"] == "/opt/vllm-venv/bin:/usr/bin"
    for name in ("gateway", "scheduler", "kvstore"):
        assert backend_of(specs[name].config) == "native"
        assert platform.command(specs[name], tmp_path / "x.yaml")[0] == sys.executable
        assert child_env(specs[name])["PATH"] == "/usr/bin"


def test_native_engines_keep_this_python_and_their_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No vLLM anywhere: a native platform never asks for it.
    monkeypatch.setattr(launcher, "vllm_python", lambda: pytest.fail("a native platform looked for vLLM"))
    plan = PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False, cores=2)
    platform = Platform(plan, tmp_path)
    for spec in platform.specs:
        assert "backend" not in spec.config.get("engine", {})
        assert platform.command(spec, tmp_path / "x.yaml")[0] == sys.executable


def test_vllm_plans_without_vllm_are_refused_before_anything_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanError, match="unknown engine backend"):
        vllm_plan(backend="tensorrt")

    def missing() -> str:
        raise VllmNotInstalledError("run `make install-vllm`")

    monkeypatch.setattr(launcher, "vllm_python", missing)
    with pytest.raises(VllmNotInstalledError):
        Platform(vllm_plan(tls=True), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # not even the certificates


def test_up_with_vllm_defaults_to_one_aggregated_instance_and_a_longer_wait(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    class FakePlatform:
        stop_requested = False

        def __init__(self, plan: PlatformPlan, run_dir: Path) -> None:
            seen["plan"] = plan

        def request_stop(self) -> None: ...

        def start(self) -> None: ...

        def wait_ready(self, timeout_s: float, on_ready) -> None:  # noqa: ANN001
            seen["timeout"] = timeout_s
            raise launcher.LaunchError("recorded")

        def stop(self) -> None: ...

    monkeypatch.setattr(launcher, "Platform", FakePlatform)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # leave pytest's own handlers alone
    runner = CliRunner()
    result = runner.invoke(cli.app, ["up", "--engine", "vllm", "--run-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    plan = seen["plan"]
    assert isinstance(plan, PlatformPlan) and (plan.backend, plan.aggregated) == ("vllm", 1)
    assert seen["timeout"] >= 600
    # Native: the pools and 600 s, as before.
    result = runner.invoke(cli.app, ["up", "--run-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert (seen["plan"].backend, seen["plan"].aggregated, seen["timeout"]) == ("native", 0, 600)
