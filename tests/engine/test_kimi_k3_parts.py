"""kimi_k3 pieces: the reference/Triton kernel switch op by op, SiTU-GLU, routing, loading
(seeded preset, bf16 and MXFP4 sharded directories), config round trip, memory accounting."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from crescent.kernels.attnres.reference import block_attn_res_reference
from crescent.kernels.kda.reference import kda_gate
from crescent.kernels.mxfp4.reference import dequantize_mxfp4, quantize_mxfp4
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3 import K3_FULL, NANO, K3Config, dense_gqa_kv_bytes_per_token, k3_footprint
from crescent.services.engine.kimi_k3.ffn import LatentMoe
from crescent.services.engine.kimi_k3.loading import load_k3_model, save_hf_dir, seeded_weights
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.ops import OpsBackend, K3Ops, select_backend, situ_glu
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.model_config import ModelConfigError
from crescent.services.model.model_source import resolve_model
from tests.engine.k3_reference import TEST_CFG

REF, TRITON = K3Ops(OpsBackend.REFERENCE), K3Ops(OpsBackend.TRITON)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@functools.cache
def _weights() -> dict[str, torch.Tensor]:
    return seeded_weights(TEST_CFG, 0)


def _logits(model: K3Model, tokens: list[int]) -> torch.Tensor:
    torch.set_num_threads(1)
    engine = Engine(model, model_id="k3", kv_capacity_tokens=8 * 16, block_size=16)
    return engine.prefill(engine.add_sequence("a", tokens))


TOKENS = list(range(3, 40))

# ---- the kernel switch ---------------------------------------------------------------------------


def test_backend_follows_the_device():
    assert select_backend("cpu") is OpsBackend.REFERENCE
    assert select_backend("cuda") is OpsBackend.TRITON
    assert K3Model(TEST_CFG, _weights()).ops.backend is OpsBackend.REFERENCE


def _kda_inputs(t: int, gen: torch.Generator):
    q, k = torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, 16, generator=gen)
    v = torch.randn(t, 4, 16, generator=gen)
    g = kda_gate(torch.randn(t, 4, 16, generator=gen), torch.zeros(4), torch.zeros(64))
    return q, k, v, g, torch.rand(t, 4, generator=gen)


@pytest.mark.parametrize("t", [1, 37])
def test_kda_segment_backends_agree(t: int):
    gen = torch.Generator().manual_seed(t)
    args = _kda_inputs(t, gen)
    state = torch.randn(4, 16, 16, generator=gen) * 0.1
    o_ref, s_ref = REF.kda_segment(*args, state, 0.25)
    o_tri, s_tri = TRITON.kda_segment(*args, state, 0.25)
    assert rel_err(o_tri, o_ref) < 1e-5 and rel_err(s_tri, s_ref) < 1e-5


def test_kda_step_backends_agree_and_leave_inputs_alone():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _kda_inputs(3, gen)
    states = torch.randn(3, 4, 16, 16, generator=gen)
    before = states.clone()
    o_ref, s_ref = REF.kda_step(q, k, v, g, beta, states, 0.25)
    o_tri, s_tri = TRITON.kda_step(q, k, v, g, beta, states, 0.25)
    assert torch.equal(states, before)
    assert rel_err(o_tri, o_ref) < 1e-5 and rel_err(s_tri, s_ref) < 1e-5


def test_mla_attention_backends_agree_on_shuffled_pages():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(8, 16, 48, generator=gen)
    table = torch.tensor([[5, 2, 7], [1, 6, 0]])
    seq_lens, cu_q = torch.tensor([40, 17]), torch.tensor([0, 9, 10])  # a prefill chunk, a decode
    q_lat, q_rope = torch.randn(10, 4, 32, generator=gen), torch.randn(10, 4, 16, generator=gen)
    ref = REF.mla_attention(q_lat, q_rope, cache, table, seq_lens, cu_q, 0.2)
    assert rel_err(TRITON.mla_attention(q_lat, q_rope, cache, table, seq_lens, cu_q, 0.2), ref) < 1e-5


def test_moe_routed_backends_agree():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, 32, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=gen)
    gate_up, down = torch.randn(8, 64, 32, generator=gen) / 6, torch.randn(8, 32, 32, generator=gen) / 6
    ref = REF.moe_routed(x, weights, ids, *REF.expert_weights(gate_up, down), situ_glu)
    tri = TRITON.moe_routed(x, weights, ids, *TRITON.expert_weights(gate_up, down), situ_glu)
    assert rel_err(tri, ref) < 1e-5


def test_attn_res_backends_agree_with_the_kernel_reference():
    gen = torch.Generator().manual_seed(6)
    sources, query, norm = torch.randn(3, 7, 64, generator=gen), torch.randn(64, generator=gen), torch.rand(64, generator=gen)
    expected = block_attn_res_reference(sources, query, norm, 1e-6)[0]
    assert rel_err(REF.attn_res(sources, query, norm, 1e-6), expected) < 1e-6
    assert rel_err(TRITON.attn_res(sources, query, norm, 1e-6), expected) < 1e-5


@pytest.mark.slow  # the whole tiny K3 under the Triton interpreter: 15 s in make test-fast
def test_whole_model_on_triton_kernels_matches_the_references():
    tokens = TOKENS[:20]
    ref = _logits(K3Model(TEST_CFG, _weights()), tokens)
    tri = _logits(K3Model(TEST_CFG, _weights(), backend=OpsBackend.TRITON), tokens)
    assert rel_err(tri, ref) < 1e-4


# ---- SiTU-GLU and routing ------------------------------------------------------------------------


def test_situ_glu_is_swiglu_near_zero_and_bounded_far_out():
    gate, up = torch.linspace(-0.05, 0.05, 11), torch.linspace(0.05, -0.05, 11)
    swiglu = torch.nn.functional.silu(gate) * up
    assert torch.allclose(situ_glu(torch.cat([gate, up])), swiglu, rtol=1e-3, atol=1e-9)
    big = situ_glu(torch.tensor([1e4, 1e4]))
    assert torch.allclose(big, torch.tensor([4.0 * 25.0]))  # beta_gate · beta_up caps the output
    assert situ_glu(torch.tensor([-1e4, 1e4])).abs().item() < 1e-6  # sigmoid closes the gate


def test_routing_is_per_token_and_offsets_balance_the_experts():
    model = K3Model(TEST_CFG, _weights())
    moe = next(f for f in model.ffn if isinstance(f, LatentMoe))
    x = torch.randn(33, TEST_CFG.hidden_size, generator=torch.Generator().manual_seed(7))
    weights, ids = moe.route(x)
    for t in (0, 5, 32):
        w1, i1 = moe.route(x[t : t + 1])
        assert torch.equal(i1[0], ids[t]) and torch.equal(w1[0], weights[t])
    # on fresh tokens, quantile-balanced offsets spread the load more evenly than none
    x = torch.randn(4096, TEST_CFG.hidden_size, generator=torch.Generator().manual_seed(8))
    balanced = torch.bincount(moe.route(x)[1].flatten(), minlength=8).float()
    unbalanced_moe = LatentMoe(TEST_CFG, dataclasses.replace(moe.w, offsets=torch.zeros(8)), moe.ops)
    plain = torch.bincount(unbalanced_moe.route(x)[1].flatten(), minlength=8).float()
    assert balanced.max() / balanced.mean() < plain.max() / plain.mean()
    assert balanced.max() / balanced.mean() < 1.25


def test_expert_load_counts_every_routed_token():
    model = K3Model(TEST_CFG, _weights())
    _logits(model, TOKENS)
    load = model.expert_load()
    moe_layers = TEST_CFG.num_layers - TEST_CFG.first_dense_layers
    assert load.shape == (moe_layers, TEST_CFG.num_experts)
    assert load.sum(1).tolist() == [len(TOKENS) * TEST_CFG.num_experts_per_tok] * moe_layers


# ---- loading ---------------------------------------------------------------------------------------


def test_seeded_preset_resolves_to_the_kimi_tokenizer_and_loads_deterministically():
    source = resolve_model("kimi-k3-nano")
    assert (source.kind, source.tokenizer, source.random_seed) == ("kimi_k3", "kimi", 0)
    a, b = load_k3_model(source), load_k3_model(source)
    assert a.config == NANO and a.config.vocab_size == 163840
    assert torch.equal(a.embed, b.embed)
    assert torch.equal(_logits(a, TOKENS), _logits(b, TOKENS))


def test_bf16_sharded_directory_loads_to_the_same_model(tmp_path):
    save_hf_dir(tmp_path / "k3-bf16", TEST_CFG, _weights(), dtype=torch.bfloat16, shards=3)
    source = resolve_model(str(tmp_path / "k3-bf16"))
    assert (source.kind, source.tokenizer) == ("kimi_k3", "kimi")
    rounded = {k: v.bfloat16().float() for k, v in _weights().items()}
    assert torch.equal(_logits(load_k3_model(source), TOKENS), _logits(K3Model(TEST_CFG, rounded), TOKENS))


def test_mxfp4_directory_dequantizes_blocks_and_scales(tmp_path):
    save_hf_dir(tmp_path / "k3-mx", TEST_CFG, _weights(), dtype=torch.float32, mxfp4=True)
    index = json.loads((tmp_path / "k3-mx" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in index["weight_map"]
    expected = {k: dequantize_mxfp4(*quantize_mxfp4(v)) if v.dim() >= 2 and v.shape[-1] % 32 == 0
                and k != "model.embed_tokens.weight" else v for k, v in _weights().items()}
    loaded = load_k3_model(resolve_model(str(tmp_path / "k3-mx")))
    assert torch.equal(_logits(loaded, TOKENS), _logits(K3Model(TEST_CFG, expected), TOKENS))


def test_incomplete_directory_names_what_is_missing(tmp_path):
    weights = dict(_weights())
    del weights["model.layers.2.self_attn.kv_b_proj.weight"]
    save_hf_dir(tmp_path / "k3", TEST_CFG, weights, shards=1)
    with pytest.raises(ModelLoadError, match="kv_b_proj"):
        load_k3_model(resolve_model(str(tmp_path / "k3")))


def test_config_round_trips_and_rejects_unknown_fields():
    assert K3Config.from_hf_dict(K3_FULL.to_hf_dict()) == K3_FULL
    with pytest.raises(ModelConfigError, match="rope_scaling"):
        K3Config.from_hf_dict({**NANO.to_hf_dict(), "rope_scaling": {"type": "yarn"}})
    with pytest.raises(ModelConfigError, match="layer_types"):
        dataclasses.replace(NANO, layer_types=("kda", "gqa"))


# ---- memory accounting -----------------------------------------------------------------------------


def test_nano_footprint_counts_latents_per_token_and_one_state():
    fp = k3_footprint(TEST_CFG)
    assert fp.kv_bytes_per_token == 2 * (32 + 16) * 4  # 2 MLA layers, c_kv + k_rope, fp32
    assert fp.state_bytes_per_sequence == 4 * (4 * 16 * 16 + (2 * 32 + 64) * 3) * 4  # 4 KDA layers
    engine = Engine(K3Model(TEST_CFG, _weights()), model_id="k3", kv_capacity_tokens=10 * 16, block_size=16)
    assert engine.cache.page_bytes() == 16 * fp.kv_bytes_per_token  # a page holds latents only
    # (the whole cache against docs/k3.md's formula: tests/engine/test_kimi_k3_snapshots.py)


def test_full_k3_caches_far_fewer_bytes_per_token_than_dense_gqa():
    fp = k3_footprint(K3_FULL)  # K3_FULL caches latents and conv tails in bf16
    assert fp.kv_bytes_per_token == 24 * (512 + 64) * 2
    assert fp.snapshot_bytes_per_block == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)
    assert fp.state_bytes_per_sequence == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 4)  # a live tail is fp32
    dense = dense_gqa_kv_bytes_per_token(num_layers=93, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert dense / fp.kv_bytes_per_token > 13
    # a 1M-token prefix cache with 32 snapshots stays well under dense GQA per token
    assert fp.bytes_per_cached_token(1 << 20, 32) < dense / 8


def test_expert_load_is_exposed_to_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    from crescent.services.engine.kimi_k3.metrics import publish_expert_load

    model = K3Model(TEST_CFG, _weights())
    registry = CollectorRegistry()
    publish_expert_load(model, registry)
    _logits(model, TOKENS)
    text = generate_latest(registry).decode()
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("crescent_engine_moe_expert_tokens_total{"))
    moe_layers = TEST_CFG.num_layers - TEST_CFG.first_dense_layers
    assert total == len(TOKENS) * TEST_CFG.num_experts_per_tok * moe_layers
    assert 'crescent_engine_moe_load_imbalance{layer="1"}' in text
