"""The native engine's device in the chart: a pod that requests a GPU computes on it."""

from __future__ import annotations

import yaml

from crescent.services.engine.settings import EngineSettings
from tests.helm.tools import by_kind, render


def _engines(*args: str) -> dict[str, dict]:
    maps = by_kind(render(*args), "ConfigMap")
    return {role: yaml.safe_load(maps[f"crescent-{role}"]["data"]["config.yaml"])["engine"] for role in ("prefill", "decode")}


def test_native_engines_on_gpu_pods_render_cuda_and_cpu_pods_cpu() -> None:
    engines = _engines()  # the defaults: one GPU per prefill and decode pod, native
    assert engines["prefill"]["device"] == engines["decode"]["device"] == "cuda"
    assert "dtype" not in engines["prefill"]  # auto: the checkpoint's on CUDA
    engines = _engines("--set", "prefill.gpus=0", "--set", "decode.settings.engine.dtype=bfloat16")
    assert engines["prefill"]["device"] == "cpu"
    assert engines["decode"]["device"] == "cuda" and engines["decode"]["dtype"] == "bfloat16"
    # what the pods load: the services' own settings accept it
    assert EngineSettings(**engines["prefill"]).device == "cpu"
    assert EngineSettings(**engines["decode"]).dtype == "bfloat16"


def test_a_multinode_native_group_stays_on_the_cpu() -> None:
    """Its tensor-parallel ranks talk gloo on the CPU (services/engine/parallel), which the engine
    refuses to combine with a CUDA device."""
    engines = _engines("--set", "prefill.multiNode.enabled=true", "--set", "prefill.multiNode.nodesPerInstance=2")
    assert engines["prefill"]["device"] == "cpu" and engines["decode"]["device"] == "cuda"
