"""``crescent plan`` counts a checkpoint's weights as it stores them: its quantization_config and dtype.

Fixtures: the tiny real-format checkpoints (tests/engine/kimi_real_format.py), written the way
transformers writes configs. Expected bytes are counted here from the configs' shapes by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.engine.kimi_real_format import K3_CONFIG, KIMI_LINEAR_CONFIG, text_config
from tests.plan.test_plan_cli import plan

MXFP4_BITS = 4.25


def _write(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _moe_layers(t: dict) -> int:
    return t["num_hidden_layers"] - t["first_k_dense_replace"]


def test_a_bf16_kimi_linear_is_counted_in_bf16_whole(tmp_path: Path) -> None:
    path = _write(tmp_path / "kimi-linear", KIMI_LINEAR_CONFIG)  # no quantization_config, torch_dtype bf16
    code, f, _ = plan("--model", str(path), "--gpus", "H100", "--context", "8k")
    assert code == 0
    w, t = f["weights"], text_config(KIMI_LINEAR_CONFIG)
    assert (w["expert_format"], w["other_format"], w["source"]) == ("bf16", "bf16", "no quantization_config")
    assert w["routed_params"] == _moe_layers(t) * t["num_experts"] * 3 * t["moe_intermediate_size"] * t["hidden_size"]
    assert w["routed_bytes"] == 2 * w["routed_params"] and w["other_bytes"] == 2 * w["other_params"]
    assert w["other_quantized_params"] == 0


def test_k3s_quantization_config_decides_which_linear_weights_are_mxfp4(tmp_path: Path) -> None:
    path = _write(tmp_path / "k3", K3_CONFIG)
    code, f, err = plan("--model", str(path), "--gpus", "H100", "--context", "4k")
    assert code == 0, err
    w, t = f["weights"], text_config(K3_CONFIG)
    lat, d = t["routed_expert_hidden_size"], t["hidden_size"]
    assert (w["expert_format"], w["other_format"], w["source"]) == ("mxfp4", "bf16", "quantization_config")
    routed = _moe_layers(t) * t["num_experts"] * 3 * t["moe_intermediate_size"] * lat
    assert w["routed_params"] == routed and w["routed_bytes"] == math.ceil(routed * MXFP4_BITS / 8)
    # routed_expert_down_proj [lat, d] and routed_expert_up_proj [d, lat] are not ignored: MXFP4;
    # attention, shared experts, dense MLPs, router, lm_head are ignored: bf16; embeddings, norms: not Linear
    latent = _moe_layers(t) * 2 * lat * d
    assert w["other_quantized_params"] == latent
    assert w["other_bytes"] == math.ceil((latent * MXFP4_BITS + (w["other_params"] - latent) * 16) / 8)


def test_experts_flag_is_for_presets_and_must_agree_with_a_checkpoint(tmp_path: Path) -> None:
    path = _write(tmp_path / "kimi-linear", KIMI_LINEAR_CONFIG)
    code, _, err = plan("--model", str(path), "--gpus", "H100", "--context", "8k", "--experts", "mxfp4")
    assert code == 2 and "stores its routed experts in bf16" in " ".join(err.replace("│", " ").split())
    assert plan("--model", str(path), "--gpus", "H100", "--context", "8k", "--experts", "bf16")[0] == 0
    code, f, _ = plan("--model", "kimi-k3", "--gpus", "16xH200", "--context", "128k", "--experts", "mxfp8")
    assert f["weights"]["expert_format"] == "mxfp8"  # (2.8 TB: it does not fit on 16 × H200, code 1)


def test_the_values_set_the_snapshot_budget_the_figures_count() -> None:
    import yaml
    from typer.testing import CliRunner

    from crescent.services.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "kimi-k3", "--gpus", "8xB300", "--context", "128k",
                                      "--snapshots", "2", "--snapshot-every-blocks", "128"])
    values = yaml.safe_load(result.stdout)
    code, f, _ = plan("--model", "kimi-k3", "--gpus", "8xB300", "--context", "128k", "--snapshots", "2")
    best = next(lay for lay in f["layouts"] if lay["name"] == f["best"])
    assert f["sequence"]["snapshot_bytes"] == 2 * 449_372_160  # counted per prefill sequence ...
    prefill, decode = values["prefill"]["settings"]["engine"], values["decode"]["settings"]["engine"]
    assert (prefill["state_snapshots"], prefill["state_snapshot_every_blocks"]) == (2 * best["sequences"], 128)
    assert decode["state_snapshots"] == 0  # ... and decode, which resumes no prefix, allocates none


def test_engine_defaults_are_the_sparse_policy() -> None:
    from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy
    from crescent.services.engine.settings import EngineSettings

    settings, policy = EngineSettings(), SnapshotPolicy()
    assert (settings.state_snapshot_every_blocks, settings.state_snapshots) == (policy.every_blocks, policy.slots)
    assert policy.every_blocks > 1 and policy.slots < 32  # not a snapshot per block, nor 14 GB of K3 states
