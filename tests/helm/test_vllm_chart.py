"""The vLLM engine backend in the chart (aggregated.backend: vllm; docs/operators.md, "Engine
backends on GPU pools"): the three GPU examples render, pass kubernetes-validate, the
LeaderWorkerSet schema and the aggregated service's own settings model, and carry the vLLM
arguments an operator would look for; what cannot run is refused at render time.

Each example is rendered once for the whole module (renders are slow). Nothing here has run on a
GPU or a cluster: the checks are static, plus the worker pod's command run in a shell against a
stand-in `vllm`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from crescent.services.aggregated.config import ENV_PREFIX, AggregatedSettings
from crescent.services.common.settings import load_settings
from crescent.services.decode.config import ENV_PREFIX as DECODE_ENV, DecodeSettings
from crescent.services.prefill.config import ENV_PREFIX as PREFILL_ENV, PrefillSettings
from crescent.services.engine_vllm.settings import VllmSettings
from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from tests.helm.crd_schemas import schema_errors
from tests.helm.test_chart_settings import _pod_env
from tests.helm.tools import CHART, EXAMPLES, REPO, by_kind, helm_template, run, tool

VLLM_EXAMPLES = {
    "kimi-k3": EXAMPLES / "kimi-k3-2x8-h200-vllm.yaml",
    "qwen3-32b": EXAMPLES / "qwen3-32b-8gpu-vllm.yaml",
    "kimi-linear": EXAMPLES / "kimi-linear-48b-8gpu-vllm.yaml",
}
CONFIG_ARGS = ["aggregated", "--config", "/etc/crescent/config.yaml"]


@functools.cache
def _manifest(name: str) -> str:
    result = helm_template(values=[VLLM_EXAMPLES[name]])
    assert result.returncode == 0, result.stderr
    return result.stdout


def _docs(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_manifest(name)) if doc]


def _engine_pods(name: str) -> list[tuple[str, dict[str, Any], int]]:
    """(kind of pod, pod spec, how many) of every aggregated pod the example runs."""
    docs = _docs(name)
    pods = [("deployment", d["spec"]["template"]["spec"], d["spec"]["replicas"])
            for d in by_kind(docs, "Deployment").values() if d["metadata"]["labels"]["app.kubernetes.io/component"] == "aggregated"]
    for lws in by_kind(docs, "LeaderWorkerSet").values():
        template = lws["spec"]["leaderWorkerTemplate"]
        pods.append(("leader", template["leaderTemplate"]["spec"], lws["spec"]["replicas"]))
        pods.append(("worker", template["workerTemplate"]["spec"], lws["spec"]["replicas"] * (template["size"] - 1)))
    return pods


def _engine_config(name: str) -> dict[str, Any]:
    return yaml.safe_load(by_kind(_docs(name), "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"])


def _gpus(spec: dict[str, Any]) -> int:
    return int(spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def test_the_examples_lint_and_validate_as_kubernetes_and_lws_objects(tmp_path: Path) -> None:
    for path in VLLM_EXAMPLES.values():
        result = run([tool("helm"), "lint", "--strict", str(CHART), "-f", str(path)])
        assert result.returncode == 0, result.stdout + result.stderr
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text("\n---\n".join(_manifest(name) for name in VLLM_EXAMPLES))
    for version in ("1.30.0", "1.37.0"):
        result = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(manifest)])
        assert result.returncode == 0, result.stdout + result.stderr
        for line in (result.stdout + result.stderr).splitlines():
            if "Couldn't find schema" in line:  # custom resources only; LeaderWorkerSet is checked below
                assert any(f"kind {kind} " in line for kind in ("ServiceMonitor", "LeaderWorkerSet")), line
    lws = [d for name in VLLM_EXAMPLES for d in _docs(name) if d["kind"] == "LeaderWorkerSet"]
    assert len(lws) == 1
    assert {key: error for key, error in schema_errors(lws).items() if error} == {}


@pytest.mark.parametrize("name", sorted(VLLM_EXAMPLES))
def test_each_example_runs_aggregated_vllm_pods_with_gpus_tp_x_pp_x_local_dp(name: str) -> None:
    values = yaml.safe_load(VLLM_EXAMPLES[name].read_text())
    vllm = values["aggregated"]["vllm"]
    nodes = values["aggregated"].get("multiNode", {}).get("nodesPerInstance", 1)
    local_dp = vllm.get("dataParallelSize", 1) // nodes
    pods = _engine_pods(name)
    assert pods and all("prefill" not in d["metadata"]["name"] and "decode" not in d["metadata"]["name"]
                        for d in _docs(name) if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    for kind, spec, _ in pods:
        container = spec["containers"][0]
        assert container["image"] == "ghcr.io/crescent-llm/crescent:0.1.0-vllm", kind
        assert _gpus(spec) == vllm["tensorParallelSize"] * vllm.get("pipelineParallelSize", 1) * local_dp, kind
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        if kind != "worker":
            assert container["args"] == CONFIG_ARGS
            startup = container["startupProbe"]
            # Model loading: the probe waits startupProbeSeconds (default 30 minutes), not seconds.
            expected = values["aggregated"].get("startupProbeSeconds", 1800)
            assert startup["periodSeconds"] * startup["failureThreshold"] == expected >= 1800
    # Every GPU of the nodes the example is sized for is asked for once.
    assert sum(_gpus(spec) * count for _, spec, count in pods) == {
        "kimi-k3": 16, "qwen3-32b": 8, "kimi-linear": 8}[name]


@pytest.mark.parametrize("name", sorted(VLLM_EXAMPLES))
def test_the_rendered_engine_settings_load_in_the_aggregated_service(tmp_path: Path, name: str) -> None:
    config = by_kind(_docs(name), "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"]
    (path := tmp_path / "config.yaml").write_text(config)
    kind, spec, _ = next(p for p in _engine_pods(name) if p[0] != "worker")
    settings = load_settings(AggregatedSettings, path, env_prefix=ENV_PREFIX, environ=_pod_env(spec["containers"][0]))
    assert settings.engine.backend == "vllm"
    assert settings.engine.model == "/models/" + yaml.safe_load(VLLM_EXAMPLES[name].read_text())["model"]["weights"]["path"]
    # Each value the example gives lands in engine.vllm under its VllmSettings name.
    given = yaml.safe_load(VLLM_EXAMPLES[name].read_text())["aggregated"]["vllm"]
    for key, value in given.items():
        assert getattr(settings.engine.vllm, _snake(key)) == value, key
    if kind == "leader":  # the data-parallel front end the headless workers join: the leader pod's IP
        assert settings.engine.vllm.engine_args == {"data_parallel_size_local": 1, "data_parallel_address": "10.1.2.3"}


def test_kimi_k3_spreads_experts_over_two_nodes_of_a_leaderworkerset() -> None:
    (lws,) = by_kind(_docs("kimi-k3"), "LeaderWorkerSet").values()
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["spec"]["replicas"] == 1
    vllm = _engine_config("kimi-k3")["engine"]["vllm"]
    assert (vllm["tensor_parallel_size"], vllm["data_parallel_size"], vllm["enable_expert_parallel"]) == (8, 2, True)
    # MXFP4 experts as Moonshot ships them: compressed-tensors mxfp4-pack-quantized.
    assert vllm["quantization"] == "compressed-tensors"
    assert (vllm["max_model_len"], vllm["gpu_memory_utilization"]) == (262144, 0.9)
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    args = worker["args"]
    flags = {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}
    assert {k: flags[k] for k in ("--data-parallel-size", "--data-parallel-size-local", "--tensor-parallel-size",
                                  "--max-model-len", "--quantization", "--gpu-memory-utilization")} == {
        "--data-parallel-size": "2", "--data-parallel-size-local": "1", "--tensor-parallel-size": "8",
        "--max-model-len": "262144", "--quantization": "compressed-tensors", "--gpu-memory-utilization": "0.9"}
    assert "--enable-expert-parallel" in args and "--trust-remote-code" in args
    # What the leader's instance gives every engine of its own (services/engine_vllm/engine.py), the
    # workers' engines get too: Crescent's KV block size, prefix caching, guidance.
    assert flags["--block-size"] == str(DEFAULT_BLOCK_SIZE) and "--enable-prefix-caching" in args
    assert json.loads(flags["--structured-outputs-config"]) == {"backend": "guidance"}
    assert "readinessProbe" not in worker  # the leader is the instance


def test_the_worker_command_runs_vllm_headless_for_its_ranks(tmp_path: Path) -> None:
    """The rendered command and args, run by /bin/sh with a stand-in `vllm` that prints its argv."""
    (lws,) = by_kind(_docs("kimi-k3"), "LeaderWorkerSet").values()
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    fake = tmp_path / "vllm"
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "LWS_WORKER_INDEX": "1",
           "LWS_LEADER_ADDRESS": "crescent-aggregated-k3-0.crescent-aggregated-k3.serving"}
    result = subprocess.run([*worker["command"], *worker["args"]], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)
    assert argv[:7] == ["serve", "/models/Kimi-K3", "--headless", "--data-parallel-address",
                        env["LWS_LEADER_ADDRESS"], "--data-parallel-start-rank", "1"]
    assert argv[7:] == worker["args"]


# vLLM's own `vllm serve` parser reads the worker's argv; the leader's engine_args names are fields
# of its AsyncEngineArgs. Run in the vLLM backend's venv (scripts/install_vllm.sh: vLLM's CPU build).
PARSE_WITH_VLLM = """
import dataclasses, json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
argv, leader_args = json.load(sys.stdin)
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
ns = parser.parse_args(argv)
fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
print(json.dumps({"parsed": {k: str(v) for k, v in vars(ns).items()}, "unknown": sorted(set(leader_args) - fields)}))
"""


@pytest.mark.slow  # starts vLLM's interpreter to run its parser
def test_vllms_own_parser_reads_the_worker_argv_and_the_leaders_engine_args(tmp_path: Path) -> None:
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-vllm (scripts/install_vllm.sh .venv-vllm)")
    (lws,) = by_kind(_docs("kimi-k3"), "LeaderWorkerSet").values()
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    argv = ["serve", worker["command"][3], "--headless", "--data-parallel-address", "leader",
            "--data-parallel-start-rank", "1", *worker["args"]]
    leader_args = [*_engine_config("kimi-k3")["engine"]["vllm"]["engine_args"], "data_parallel_address"]
    result = subprocess.run([str(python), "-c", PARSE_WITH_VLLM], input=json.dumps([argv, leader_args]),
                            capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["unknown"] == []
    parsed = out["parsed"]
    assert (parsed["headless"], parsed["data_parallel_start_rank"], parsed["data_parallel_size_local"]) == ("True", "1", "1")
    assert (parsed["tensor_parallel_size"], parsed["data_parallel_size"], parsed["enable_expert_parallel"]) == ("8", "2", "True")
    assert (parsed["quantization"], parsed["max_model_len"], parsed["block_size"]) == ("compressed-tensors", "262144", "64")


def test_qwen3_runs_eight_one_gpu_instances_and_kimi_linear_two_of_four() -> None:
    ((_, qwen, replicas),) = _engine_pods("qwen3-32b")
    assert (replicas, _gpus(qwen)) == (8, 1)
    vllm = _engine_config("qwen3-32b")["engine"]["vllm"]
    assert (vllm["tensor_parallel_size"], vllm["max_model_len"], vllm["gpu_memory_utilization"]) == (1, 32768, 0.9)
    assert "quantization" not in vllm  # bf16: nothing for vLLM to be told
    ((_, linear, replicas),) = _engine_pods("kimi-linear")
    assert (replicas, _gpus(linear)) == (2, 4)
    vllm = _engine_config("kimi-linear")["engine"]["vllm"]
    assert (vllm["tensor_parallel_size"], vllm["max_model_len"], vllm["trust_remote_code"]) == (4, 1048576, True)


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


@pytest.mark.parametrize("role", ["aggregated", "prefill", "decode"])
def test_the_vllm_values_are_the_engine_settings_one_to_one(role: str) -> None:
    """values.yaml's <role>.vllm has a key per VllmSettings field, with the field's default."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())[role]["vllm"]
    assert {_snake(k) for k in values} == set(VllmSettings.model_fields)
    defaults = VllmSettings()
    for key, value in values.items():
        assert getattr(defaults, _snake(key)) == value, key


def test_prefill_and_decode_pools_on_vllm_render_with_the_kvstore_between_them(tmp_path: Path) -> None:
    """Both pools on vLLM: each pod on the vLLM image with the GPUs vLLM's parallelism needs, and
    each role's rendered settings load in its service with the node's kvstore to hand over through."""
    result = helm_template("--set", "prefill.backend=vllm", "--set", "decode.backend=vllm",
                           "--set", "prefill.vllm.tensorParallelSize=2", "--set", "decode.vllm.tensorParallelSize=4",
                           "--set", "decode.vllm.dataParallelSize=2")
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    deployments = by_kind(docs, "Deployment")
    for role, loader, prefix, gpus in (("prefill", PrefillSettings, PREFILL_ENV, 2), ("decode", DecodeSettings, DECODE_ENV, 8)):
        spec = deployments[f"crescent-{role}-g0"]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["image"].endswith("-vllm"), container["image"]
        assert _gpus(spec) == gpus
        (path := tmp_path / f"{role}.yaml").write_text(by_kind(docs, "ConfigMap")[f"crescent-{role}"]["data"]["config.yaml"])
        settings = load_settings(loader, path, env_prefix=prefix, environ=_pod_env(container))
        assert settings.engine.backend == "vllm" and settings.engine.vllm.kv_connector
        assert settings.kvstore_address, f"a vLLM {role} reaches the node's kvstore"
    native = helm_template()
    assert native.returncode == 0, native.stderr
    decode = yaml.safe_load(by_kind([d for d in yaml.safe_load_all(native.stdout) if d], "ConfigMap")
                            ["crescent-decode"]["data"]["config.yaml"])
    assert "kvstore_address" not in decode, "the native decode takes its KV in the handoff"


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "model.id=Qwen/Qwen3-32B"], 'native cannot load "Qwen/Qwen3-32B"'),
    (["--set", "model.weights.source=pvc", "--set", "model.weights.pvc.existingClaim=w",
      "--set", "model.weights.path=deepseek-ai/DeepSeek-V3"], "aggregated.backend=vllm"),
    (["--set", "decode.backend=vllm"], "a vLLM prefill hands its prompts only to a vLLM decode"),
    (["--set", "prefill.backend=vllm", "--set", "decode.backend=vllm", "--set", "kvstore.enabled=false"],
     "through the node's kvstore: set kvstore.enabled=true"),
    (["--set", "prefill.backend=vllm", "--set", "decode.backend=vllm", "--set", "decode.vllm.kvConnector=false"],
     "decode.vllm.kvConnector: false leaves a vLLM decode without the handoff"),
    (["--values", str(VLLM_EXAMPLES["qwen3-32b"]), "--set", "model.weights.source=image"],
     'serves only the embedded smollm2-135m-instruct, not "qwen3-32b"'),
    (["--values", str(VLLM_EXAMPLES["kimi-k3"]), "--set", "aggregated.vllm.dataParallelSize=3"],
     "must be a multiple of aggregated.multiNode.nodesPerInstance"),
])
def test_what_cannot_run_is_refused_with_the_value_to_change(args: list[str], message: str) -> None:
    result = helm_template(*args)
    assert result.returncode != 0 and message in result.stderr, result.stderr
