"""MXFP4 routed experts kept packed in memory (4.25 bits per weight) give the same outputs as
experts dequantized at load: bitwise on the reference backend, to fp32 rounding through the
Triton MXFP4 matmul; resident bytes measured on the loaded model."""

from __future__ import annotations

import math

import pytest
import torch

from crescent.kernels.mxfp4 import Mxfp4Tensor, dequantize_mxfp4, quantize_mxfp4
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.ffn import LatentMoe
from crescent.services.engine.kimi_k3.loading import load_k3_model, save_hf_dir, seeded_weights
from crescent.services.engine.kimi_k3.ops import OpsBackend, K3Ops, situ_glu
from crescent.services.instance.runtime import build_engine
from crescent.services.engine.settings import EngineSettings
from crescent.services.model.model_source import resolve_model
from tests.engine.k3_reference import TEST_CFG
from tests.engine.kimi_real_format import K3_CONFIG, real_tensors, write_checkpoint

REF, TRITON = K3Ops(OpsBackend.REFERENCE), K3Ops(OpsBackend.TRITON)
TOKENS = [5, 17, 300, 42, 7, 99, 250, 3, 11, 64, 128, 200, 31, 77, 411, 8, 19, 23, 505, 6]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_packed_tensor_stands_for_its_weight_at_4_25_bits() -> None:
    w = torch.randn(6, 64, 96)  # [experts, out, in]
    packed = Mxfp4Tensor.quantize(w)
    assert packed.shape == w.shape and packed.dim() == 3
    assert packed.nbytes == w.numel() * 4.25 / 8  # 16 code bytes + 1 scale byte per 32 weights
    assert torch.equal(packed.dequantize(), dequantize_mxfp4(*quantize_mxfp4(w)))
    assert torch.equal(packed[2].dequantize(), packed.dequantize()[2]) and packed[2].shape == (64, 96)
    assert packed.to("cpu", torch.float32).blocks.dtype == torch.uint8  # a compute dtype leaves it packed
    both = Mxfp4Tensor.cat_rows([packed[0], packed[1]])
    assert torch.equal(both.dequantize(), torch.cat([packed[0].dequantize(), packed[1].dequantize()]))
    assert torch.equal(Mxfp4Tensor.stack([packed[1], packed[4]]).dequantize(), packed.dequantize()[[1, 4]])
    with pytest.raises(ValueError, match="uint8"):
        Mxfp4Tensor(packed.blocks.float(), packed.scales)
    with pytest.raises(ValueError, match="disagree"):
        Mxfp4Tensor(packed.blocks, packed.scales[..., :1])


def _routing(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    return torch.rand(t, k), ids


def test_moe_routed_packed_equals_dequantized_on_both_backends() -> None:
    torch.manual_seed(0)
    e, f, lat, t, k = 8, 64, 96, 13, 2
    gate_up, down = Mxfp4Tensor.quantize(torch.randn(e, 2 * f, lat) / 10), Mxfp4Tensor.quantize(torch.randn(e, lat, f) / 8)
    x = torch.randn(t, lat)
    weights, ids = _routing(t, e, k)
    dense = (gate_up.dequantize(), down.dequantize())
    want = REF.moe_routed(x, weights, ids, *REF.expert_weights(*dense), situ_glu)
    got = REF.moe_routed(x, weights, ids, *REF.expert_weights(gate_up, down), situ_glu)
    assert torch.equal(got, want)  # the reference decodes the same fp32 weights per expert
    # Triton: packed experts through mxfp4_matmul vs dequantized through grouped_matmul
    tri_packed = TRITON.moe_routed(x, weights, ids, *TRITON.expert_weights(gate_up, down), situ_glu)
    tri_dense = TRITON.moe_routed(x, weights, ids, *TRITON.expert_weights(*dense), situ_glu)
    assert rel_err(tri_packed, want) < 1e-5 and rel_err(tri_dense, want) < 1e-5


def _experts(model) -> list:
    return [w for f in model.ffn if isinstance(f, LatentMoe) for w in f.experts]


def _logits(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.set_num_threads(1)
    engine = Engine(model, model_id="k3", kv_capacity_tokens=8 * 16, block_size=16)
    seq = engine.add_sequence("a", tokens)
    prefill = engine.prefill(seq)
    seq.token_ids.append(int(prefill.argmax()))  # one decode step continues it
    return prefill, engine.decode_step([seq])[0]


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("k3-mx")
    save_hf_dir(path, TEST_CFG, seeded_weights(TEST_CFG, 0), dtype=torch.float32, mxfp4=True)
    return path


def test_packed_model_equals_dequantized_and_keeps_4_25_bits_resident(mxfp4_dir) -> None:
    source = resolve_model(str(mxfp4_dir))
    packed = load_k3_model(source)  # the default keeps experts packed
    dense = load_k3_model(source, mxfp4_experts="dequantize")
    assert all(isinstance(w, Mxfp4Tensor) for w in _experts(packed))
    assert all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in _experts(dense))
    # resident bytes of the routed experts, measured on the loaded models
    params = sum(math.prod(w.shape) for w in _experts(packed))
    moe_layers = sum(TEST_CFG.is_moe_layer(i) for i in range(TEST_CFG.num_layers))
    assert params == moe_layers * TEST_CFG.num_experts * 3 * TEST_CFG.moe_intermediate_size * TEST_CFG.expert_input_size
    packed_bytes = sum(w.nbytes for w in _experts(packed))
    dense_bytes = sum(w.numel() * w.element_size() for w in _experts(dense))
    assert packed_bytes * 8 / params == 4.25 and dense_bytes * 8 / params == 32
    # same logits, prefill and a decode step, bit for bit
    for a, b in zip(_logits(packed, TOKENS), _logits(dense, TOKENS), strict=True):
        assert torch.equal(a, b)


def test_a_real_k3_checkpoint_keeps_its_compressed_tensors_experts_packed(tmp_path) -> None:
    # kimi_k3 nested format, experts as weight_packed [out, in/2] + weight_scale [out, in/32]
    source = resolve_model(str(write_checkpoint(tmp_path / "k3", K3_CONFIG, real_tensors(K3_CONFIG))))
    packed, dense = load_k3_model(source), load_k3_model(source, mxfp4_experts="dequantize")
    assert _experts(packed) and all(isinstance(w, Mxfp4Tensor) for w in _experts(packed))
    params = sum(math.prod(w.shape) for w in _experts(packed))
    assert sum(w.nbytes for w in _experts(packed)) * 8 / params == 4.25
    for a, b in zip(_logits(packed, TOKENS[:12]), _logits(dense, TOKENS[:12]), strict=True):
        assert torch.equal(a, b)


def test_engine_setting_chooses_packed_or_dequantized(mxfp4_dir) -> None:
    for choice, kind in (("packed", Mxfp4Tensor), ("dequantize", torch.Tensor)):
        engine = build_engine(EngineSettings(model=str(mxfp4_dir), kv_capacity_tokens=64, block_size=16,
                                             threads=1, mxfp4_experts=choice), progress=False)
        assert all(isinstance(w, kind) for w in _experts(engine.model))
    with pytest.raises(ValueError, match="mxfp4_experts"):
        EngineSettings(mxfp4_experts="int4")
