"""``crescent plan`` on K3's published shape: its figures against hand computation, its Helm
values through the real chart and the decode service's settings, and its refusals."""

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
from crescent.services.engine.kimi_k3.config import NANO
from tests.helm.tools import by_kind, render

MIB = 1 << 20
H200 = 143_771 * MIB          # nvidia-smi's total for an H200
MILLION = 1 << 20             # "1M" context = max_position_embeddings = 2**20
# K3's published shape: 93 layers (69 KDA + 24 MLA), the first dense, 896 experts of
# 3 x 3072 x 3584 (latent MoE) in the other 92; MLA latent 512 + RoPE key 64; KDA 96 heads of 128.
ROUTED_PARAMS = 92 * 896 * 3 * 3072 * 3584
LATENT_PER_TOKEN = 24 * (512 + 64) * 2                                 # bf16: 27,648 B
KDA_STATE = 69 * (96 * 128 * 128 * 4 + (3 * 96 * 128) * 3 * 2)       # a snapshot: fp32 state + bf16 conv tails
LIVE_STATE = 69 * (96 * 128 * 128 * 4 + (3 * 96 * 128) * 3 * 4)      # a running sequence's: conv tails in fp32


def plan(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    figures = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.exit_code, figures, result.stderr


def test_k3_weights_are_about_1_56_tb_at_4_25_bits_per_expert_weight() -> None:
    code, f, _ = plan("--model", "kimi-k3", "--gpus", "16xH200", "--context", "1M")
    assert code == 0
    w = f["weights"]
    assert w["routed_params"] == ROUTED_PARAMS                      # 2.72 T routed expert weights
    assert w["routed_bytes"] == math.ceil(ROUTED_PARAMS * 4.25 / 8)  # 4 bits + an E8M0 byte per 32
    assert 45e9 < w["other_params"] < 55e9                         # attention, shared experts, embeddings
    assert w["total_bytes"] == w["routed_bytes"] + 2 * w["other_params"]  # the rest in bf16
    assert abs(w["total_bytes"] / 1.56e12 - 1) < 0.01


def test_k3_sequence_at_1m_tokens_is_latents_plus_one_state_plus_the_snapshot_budget() -> None:
    code, f, _ = plan("--model", "kimi-k3", "--gpus", "16xH200", "--context", "1M", "--snapshots", "4")
    assert code == 0
    s = f["sequence"]
    assert LATENT_PER_TOKEN == 27_648 and KDA_STATE == 449_372_160  # docs/k3.md's figures
    assert s["latent_bytes"] == MILLION * LATENT_PER_TOKEN            # 29.0 GB
    assert s["state_bytes"] == LIVE_STATE == 464_633_856
    assert s["snapshot_bytes"] == 4 * KDA_STATE
    assert s["total_bytes"] == MILLION * 27_648 + LIVE_STATE + 4 * KDA_STATE


def test_k3_on_16_h200_layouts_and_sequences_by_hand() -> None:
    code, f, err = plan("--model", "kimi-k3", "--gpus", "16xH200", "--context", "1M", "--snapshots", "4")
    assert code == 0
    layouts = {lay["name"]: lay for lay in f["layouts"]}
    routed, other = f["weights"]["routed_bytes"], 2 * f["weights"]["other_params"]
    usable = int(H200 * 0.9)
    states = LIVE_STATE + 4 * KDA_STATE  # live state + 4 snapshots, split by value head under attention TP

    tp = layouts["TP16"]
    assert tp["weights_per_gpu"] == math.ceil((routed + other) / 16)             # 96.8 GB
    assert tp["sequence_bytes_per_gpu"] == MILLION * LATENT_PER_TOKEN + math.ceil(states * 6 / 96)
    assert tp["sequences"] == (usable - tp["weights_per_gpu"]) // tp["sequence_bytes_per_gpu"] == 1

    dp2 = layouts["EP16, attn TP8×DP2"]  # 56 whole experts per GPU, attention split 8 ways, 2 groups
    assert dp2["weights_per_gpu"] == math.ceil(routed * 56 / 896) + math.ceil(other / 8)
    assert dp2["sequence_bytes_per_gpu"] == MILLION * LATENT_PER_TOKEN + math.ceil(states * 12 / 96)
    assert dp2["sequences"] == 2 * ((usable - dp2["weights_per_gpu"]) // dp2["sequence_bytes_per_gpu"]) == 2

    dp16 = layouts["EP16, attn DP16"]  # replicating 101.7 GB of non-expert weights leaves no room
    assert dp16["weights_per_gpu"] > usable and dp16["sequences"] == 0
    assert f["best"] == "EP16, attn TP8×DP2"
    assert f["helm_values"] is None and "spans 2 nodes" in err  # the chart runs one pod per instance


def test_k3_does_not_fit_on_one_8_h200_node_and_says_how_many_would() -> None:
    code, f, err = plan("--model", "kimi-k3", "--gpus", "8xH200", "--context", "1M")
    assert code == 1 and "does not fit" in err
    assert f["layouts"][0]["weights_per_gpu"] == math.ceil(f["weights"]["total_bytes"] / 8)  # 193.5 GB > 141
    needed = f["min_gpus"]
    assert f"at least {needed} × H200" in " ".join(err.split())
    assert plan("--gpus", f"{needed}xH200", "--context", "1M")[1]["best"] is not None
    assert plan("--gpus", f"{needed - 1}xH200", "--context", "1M")[1]["best"] is None


@pytest.mark.slow
def test_helm_values_render_in_the_chart_and_load_in_the_decode_service(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "crescent.services.cli", "plan", "--model", "kimi-k3",
                             "--gpus", "8xB300", "--context", "128k"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "layouts on 8 × B300" in result.stderr and "EP8, attn TP4×DP2" in result.stderr  # the rich table
    values = yaml.safe_load(result.stdout)
    code, f, _ = plan("--model", "kimi-k3", "--gpus", "8xB300", "--context", "128k")
    best = next(lay for lay in f["layouts"] if lay["name"] == f["best"])
    engine = values["decode"]["settings"]["engine"]
    assert values["decode"]["gpus"] == values["prefill"]["gpus"] == 8
    # decode keeps no snapshots, and its batch is the layout's sequences planned without them
    decode_best = next(lay for lay in f["decode_layouts"] if lay["name"] == f["best"])
    latents = 131_072 * 27_648
    state = -(-464_633_856 * (-(-96 // decode_best["tensor_parallel"])) // 96)
    assert decode_best["sequences"] == (decode_best["cache_budget_per_gpu"] // (latents + state)
                                        * decode_best["data_parallel"]) > best["sequences"]
    assert engine == {"kv_capacity_tokens": decode_best["sequences"] * 131_072, "block_size": 64,
                      "max_batch_size": decode_best["sequences"], "state_snapshots": 0}
    # prefill's prefix cache: exactly the snapshot budget the plan counted (4 per sequence by default), at turn ends
    prefill = values["prefill"]["settings"]["engine"]
    assert prefill["kv_capacity_tokens"] == best["sequences"] * 131_072
    assert (prefill["state_snapshots"], prefill["state_snapshot_every_blocks"]) == (4 * best["sequences"], 0)
    assert f["sequence"]["snapshot_bytes"] == 4 * 449_372_160
    path = tmp_path / "plan-values.yaml"
    path.write_text(result.stdout)
    docs = render(values=[path])  # the chart's schema rejects unknown keys
    from crescent.services.common.settings import load_settings
    from crescent.services.decode.config import ENV_PREFIX, DecodeSettings

    config = tmp_path / "decode.yaml"
    config.write_text(by_kind(docs, "ConfigMap")["crescent-decode"]["data"]["config.yaml"])
    settings = load_settings(DecodeSettings, config, env_prefix=ENV_PREFIX, environ={})
    assert (settings.engine.kv_capacity_tokens, settings.engine.max_batch_size, settings.engine.state_snapshots) == (
        decode_best["sequences"] * 131_072, decode_best["sequences"], 0)
    from crescent.services.prefill.config import ENV_PREFIX as PREFILL_PREFIX, PrefillSettings

    config.write_text(by_kind(docs, "ConfigMap")["crescent-prefill"]["data"]["config.yaml"])
    prefill_settings = load_settings(PrefillSettings, config, env_prefix=PREFILL_PREFIX, environ={})
    assert prefill_settings.engine.state_snapshots == 4 * best["sequences"]
    decode = next(d for d in docs if d["kind"] == "Deployment" and "decode" in d["metadata"]["name"])
    assert decode["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] in (8, "8")


def test_a_model_directory_plans_like_its_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(NANO.to_hf_dict()))
    code, from_dir, _ = plan("--model", str(tmp_path), "--gpus", "H100", "--context", "8k")
    assert code == 0
    code, preset, _ = plan("--model", "kimi-k3-nano", "--gpus", "H100", "--context", "8k")
    for key in ("weights", "sequence", "layouts"):
        assert from_dir[key] == preset[key]
    assert preset["sequence"]["context_tokens"] == 8192


def test_a_real_nested_k3_config_is_read_by_the_loader(tmp_path: Path) -> None:
    from tests.engine.kimi_real_format import K3_CONFIG, text_config

    (tmp_path / "config.json").write_text(json.dumps(K3_CONFIG))  # model_type kimi_k3 + text_config
    code, f, _ = plan("--model", str(tmp_path), "--gpus", "H100", "--context", "4k")
    text = text_config(K3_CONFIG)
    assert code == 0 and f["sequence"]["context_tokens"] == 4096
    n_mla = len(text["linear_attn_config"]["full_attn_layers"])
    assert f["sequence"]["latent_bytes"] == 4096 * n_mla * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 2


@pytest.mark.parametrize("args,message", [
    (["--gpus", "8xH300"], "unknown GPU 'H300'"),
    (["--gpus", "eight"], "unknown GPU"),
    (["--gpus", "8xH200", "--context", "2M"], "exceeds the model's context window"),
    (["--gpus", "8xH200", "--context", "lots"], "expected a token count"),
    (["--gpus", "8xH200", "--experts", "int3"], "expected one of mxfp4, mxfp8, bf16"),
    (["--gpus", "8xH200", "--model", "/nonexistent/dir"], "nor a directory with a config.json"),
])
def test_bad_arguments_are_named(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())
