"""``crescent plan --backend vllm``: chart values for vLLM's engine on aggregated instances. Its
figures match the GPU examples in helm/examples (K3 on 2 x 8 H200, Qwen3-32B on one 8-GPU node),
its printed values render through the chart's schema into the pods the examples describe, and a
dense model's figures are checked by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from crescent.services.cli import app
from tests.helm.tools import EXAMPLES, by_kind, render

MIB = 1 << 20
H200 = 143_771 * MIB
QWEN3_32B_PARAMS = 32_762_123_264        # from its config.json: 2 x 151936 x 5120 + 64 x 487,598,336 + 5120
QWEN3_KV_PER_TOKEN = 64 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 = 256 KiB
VLLM_KEYS = ("tensorParallelSize", "dataParallelSize", "enableExpertParallel", "quantization", "maxModelLen",
             "gpuMemoryUtilization")


def plan(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}, result.stderr


def printed_values(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "crescent.services.cli", "plan", *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _key_figures(values: dict[str, Any]) -> dict[str, Any]:
    aggregated = values["aggregated"]
    return {"backend": aggregated["backend"], "replicas": aggregated.get("replicas", 1),
            "nodesPerInstance": aggregated.get("multiNode", {}).get("nodesPerInstance", 1),
            "gpu": aggregated["nodeSelector"]["nvidia.com/gpu.product"],
            **{k: aggregated["vllm"].get(k, {"dataParallelSize": 1, "enableExpertParallel": False}.get(k))
               for k in VLLM_KEYS}}


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


@pytest.mark.slow
def test_k3_on_two_h200_nodes_is_the_examples_expert_parallel_layout(tmp_path: Path) -> None:
    args = ("--model", "kimi-k3", "--gpus", "16xH200", "--context", "256k", "--backend", "vllm")
    code, f, _ = plan(*args)
    assert code == 0 and f["best"] == "EP16, attn TP8×DP2"
    best = next(lay for lay in f["layouts"] if lay["name"] == f["best"])
    assert (best["tensor_parallel"], best["data_parallel"], best["expert_parallel"], best["sequences"]) == (8, 2, True, 8)
    # Replicating attention on every GPU (DP16, vLLM's single-node EP recipe) leaves no room on an H200.
    dp16 = next(lay for lay in f["layouts"] if lay["name"] == "EP16, attn DP16")
    assert dp16["weights_per_gpu"] > int(H200 * 0.9) and dp16["sequences"] == 0
    values = f["helm_values"]
    assert _key_figures(values) == _key_figures(_example("kimi-k3-2x8-h200-vllm.yaml")) == {
        "backend": "vllm", "replicas": 1, "nodesPerInstance": 2, "gpu": "NVIDIA-H200", "tensorParallelSize": 8,
        "dataParallelSize": 2, "enableExpertParallel": True, "quantization": "compressed-tensors",
        "maxModelLen": 262144, "gpuMemoryUtilization": 0.9}
    assert values["aggregated"]["vllm"]["trustRemoteCode"] is True
    # The YAML it prints renders through the chart's schema: one instance of two 8-GPU pods.
    path = tmp_path / "k3.yaml"
    path.write_text(printed_values(*args))
    assert yaml.safe_load(path.read_text()) == values
    docs = render("--set", "model.weights.source=pvc", "--set", "model.weights.path=Kimi-K3",
                  "--set", "model.weights.pvc.existingClaim=model-store", values=[path])
    (lws,) = by_kind(docs, "LeaderWorkerSet").values()
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    for pod in ("leaderTemplate", "workerTemplate"):
        assert template[pod]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    from crescent.services.aggregated.config import ENV_PREFIX, AggregatedSettings
    from crescent.services.common.settings import load_settings

    config = tmp_path / "aggregated.yaml"
    config.write_text(by_kind(docs, "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"])
    settings = load_settings(AggregatedSettings, config, env_prefix=ENV_PREFIX, environ={})
    assert (settings.engine.backend, settings.engine.vllm.tensor_parallel_size,
            settings.engine.vllm.data_parallel_size, settings.engine.vllm.quantization) == ("vllm", 8, 2, "compressed-tensors")


@pytest.mark.slow
def test_qwen3_32b_figures_by_hand_and_the_eight_gpu_examples(tmp_path: Path) -> None:
    code, f, _ = plan("--model", "qwen3-32b", "--gpus", "1xH200", "--context", "32k", "--backend", "vllm")
    assert code == 0
    assert f["weights"] == {"params": QWEN3_32B_PARAMS, "bytes": 2 * QWEN3_32B_PARAMS}  # 65.5 GB in bf16
    assert f["kv_bytes_per_token"] == QWEN3_KV_PER_TOKEN
    (tp1,) = f["layouts"]
    assert tp1["sequences"] == (int(H200 * 0.9) - 2 * QWEN3_32B_PARAMS) // (32768 * QWEN3_KV_PER_TOKEN) == 8
    values = f["helm_values"]
    assert _key_figures(values) == _key_figures(_example("qwen3-32b-8gpu-vllm.yaml")) == {
        "backend": "vllm", "replicas": 8, "nodesPerInstance": 1, "gpu": "NVIDIA-H200", "tensorParallelSize": 1,
        "dataParallelSize": 1, "enableExpertParallel": False, "quantization": None, "maxModelLen": 32768,
        "gpuMemoryUtilization": 0.9}
    # On H100s one GPU holds a single 32k sequence: the one-supernode example's pods take two.
    code, h100, _ = plan("--model", "qwen3-32b", "--gpus", "2xH100", "--context", "32k", "--backend", "vllm")
    (tp2,) = h100["layouts"]
    assert tp2["weights_per_gpu"] == math.ceil(2 * QWEN3_32B_PARAMS / 2) and tp2["sequences"] == 10
    assert _key_figures(h100["helm_values"]) == _key_figures(_example("one-supernode-8gpu.yaml"))
    # Printed values render: eight one-GPU aggregated pods on vLLM's image.
    path = tmp_path / "qwen.yaml"
    path.write_text(printed_values("--model", "qwen3-32b", "--gpus", "1xH200", "--context", "32k", "--backend", "vllm"))
    docs = render("--set", "model.weights.source=pvc", "--set", "model.weights.path=Qwen3-32B",
                  "--set", "model.weights.pvc.existingClaim=llm-weights", values=[path])
    (deployment,) = [d for d in by_kind(docs, "Deployment").values() if "-aggregated-" in d["metadata"]["name"]]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert (deployment["spec"]["replicas"], container["resources"]["limits"]["nvidia.com/gpu"]) == (8, 1)
    assert container["image"].endswith("-vllm")


def test_vllm_layouts_keep_tensor_parallel_groups_inside_a_node() -> None:
    """On GB200 trays (4 GPUs a node) a 16-GPU K3 instance at 1M tokens would do best with attention
    TP8 (two trays per group); vLLM's multi-node data parallelism keeps TP inside a pod, so TP4."""
    code, native, _ = plan("--model", "kimi-k3", "--gpus", "16xGB200", "--context", "1M")
    assert code == 0 and native["best"] == "EP16, attn TP8×DP2" and native["helm_values"] is None
    code, vllm, _ = plan("--model", "kimi-k3", "--gpus", "16xGB200", "--context", "1M", "--backend", "vllm")
    assert code == 0 and vllm["best"] == "EP16, attn TP4×DP4"
    aggregated = vllm["helm_values"]["aggregated"]
    assert aggregated["multiNode"] == {"enabled": True, "nodesPerInstance": 4}
    assert (aggregated["vllm"]["tensorParallelSize"], aggregated["vllm"]["dataParallelSize"]) == (4, 4)
    # Where only cross-node tensor parallelism would fit, it says so.
    code, f, err = plan("--model", "kimi-k3", "--gpus", "12xGB200", "--context", "1M", "--backend", "vllm")
    assert code == 1 and f["best"] is None and "tensor-parallel groups fit in one node" in " ".join(err.split())


def test_a_dense_model_gets_no_native_values_and_names_the_backend_that_serves_it() -> None:
    code, f, err = plan("--model", "qwen3-32b", "--gpus", "1xH200", "--context", "32k")
    assert code == 0 and f["helm_values"] is None and f["best"] == "TP1"
    assert "native engine does not load qwen3" in " ".join(err.split()) and "--backend vllm" in err


def test_a_dense_model_directory_plans_like_its_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))
    _, from_dir, _ = plan("--model", str(tmp_path), "--gpus", "2xH100", "--context", "32k", "--backend", "vllm")
    _, preset, _ = plan("--model", "qwen3-32b", "--gpus", "2xH100", "--context", "32k", "--backend", "vllm")
    for key in ("weights", "kv_bytes_per_token", "layouts"):
        assert from_dir[key] == preset[key]


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "8xH200", "--backend", "sglang"], "expected one of native, vllm"),
    (["--gpus", "8xH200", "--model", "qwen3-32b", "--context", "64k"], "exceeds the model's context window"),
])
def test_bad_arguments_are_named(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())
