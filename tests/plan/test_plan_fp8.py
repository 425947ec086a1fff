"""`crescent plan --kv-cache-dtype fp8`: the MLA latents of a K3-class model at one byte, the
rest of the cache as before, and the values setting the dtype the figures assumed."""

from __future__ import annotations

from tests.plan.test_plan_cli import KDA_STATE, LATENT_PER_TOKEN, LIVE_STATE, MILLION, plan


def test_fp8_halves_the_latent_part_only() -> None:
    args = ("--model", "kimi-k3", "--gpus", "16xH200", "--context", "1M", "--snapshots", "4")
    code, bf16, _ = plan(*args)
    code8, fp8, _ = plan(*args, "--kv-cache-dtype", "fp8")
    assert code == code8 == 0
    assert fp8["sequence"]["latent_bytes"] * 2 == bf16["sequence"]["latent_bytes"] == MILLION * LATENT_PER_TOKEN
    assert fp8["sequence"]["state_bytes"] == LIVE_STATE           # fp32 KDA states and live tails
    assert fp8["sequence"]["snapshot_bytes"] == 4 * KDA_STATE     # snapshot tails stay bf16
    best = {p["name"]: p["sequences"] for p in bf16["layouts"]}
    assert all(p["sequences"] >= best[p["name"]] for p in fp8["layouts"])
    assert max(p["sequences"] for p in fp8["layouts"]) > max(best.values())
    assert fp8["kv_cache_dtype"] == "fp8"


def test_fp8_values_set_the_engine_and_vllm_cache_dtype() -> None:
    args = ("--model", "kimi-k3", "--gpus", "16xH200", "--context", "128k", "--kv-cache-dtype", "fp8")
    _, native, _ = plan(*args)
    _, vllm, _ = plan(*args, "--backend", "vllm")
    if native["helm_values"] is not None:  # one instance spanning two nodes has no native values
        assert native["helm_values"]["prefill"]["settings"]["engine"]["kv_cache_dtype"] == "fp8"
    assert vllm["helm_values"]["aggregated"]["vllm"]["kvCacheDtype"] == "fp8"
    _, auto, _ = plan("--model", "kimi-k3-nano", "--gpus", "1xH200")
    assert "kv_cache_dtype" not in auto["helm_values"]["prefill"]["settings"]["engine"]


def test_fp8_is_refused_where_it_is_not_planned() -> None:
    code, _, err = plan("--model", "qwen3-32b", "--gpus", "1xH200", "--kv-cache-dtype", "fp8")
    assert code != 0 and "K3-class" in err
    code, _, err = plan("--model", "kimi-k3", "--gpus", "16xH200", "--kv-cache-dtype", "fp4")
    assert code != 0 and "--kv-cache-dtype" in err
