"""The native engine's device in the chart: a pod that requests a GPU computes on it, in every
role (prefill, decode and the aggregated pool)."""

from __future__ import annotations

import yaml

from crescent.services.engine.settings import EngineSettings
from tests.helm.tools import by_kind, render


AGGREGATED_ALONE = ("--set", "aggregated.enabled=true", "--set", "prefill.enabled=false", "--set", "decode.enabled=false")


def _engines(*args: str, roles: tuple[str, ...] = ("prefill", "decode")) -> dict[str, dict]:
    maps = by_kind(render(*args), "ConfigMap")
    return {role: yaml.safe_load(maps[f"crescent-{role}"]["data"]["config.yaml"])["engine"] for role in roles}


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



def test_the_aggregated_pool_follows_the_same_rule() -> None:
    """Aggregated engines (prefill and decode in one pod) read the same engine settings."""
    (engine,) = _engines(*AGGREGATED_ALONE, roles=("aggregated",)).values()  # its default: one GPU a pod
    assert engine["device"] == "cuda" and "dtype" not in engine
    assert EngineSettings(**engine).device == "cuda"
    (engine,) = _engines(*AGGREGATED_ALONE, "--set", "aggregated.gpus=0", roles=("aggregated",)).values()
    assert engine["device"] == "cpu"
    (engine,) = _engines(*AGGREGATED_ALONE, "--set", "aggregated.settings.engine.dtype=bfloat16",
                         "--set", "aggregated.settings.engine.device=cuda:1", roles=("aggregated",)).values()
    assert (engine["device"], engine["dtype"]) == ("cuda:1", "bfloat16")
    assert EngineSettings(**engine).dtype == "bfloat16"
    (engine,) = _engines(*AGGREGATED_ALONE, "--set", "aggregated.multiNode.enabled=true",
                         roles=("aggregated",)).values()
    assert engine["device"] == "cpu"  # its tensor-parallel ranks talk gloo, as a prefill group's do
