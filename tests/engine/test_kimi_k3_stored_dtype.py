"""A kimi_k3 checkpoint stored in bf16 and served in bf16 (a GPU's "auto") reaches the model in
bf16: the loader keeps float tensors as stored rather than widening them to an fp32 host copy that
K3Model would round straight back (twice the host memory for the same bits). In fp32 compute the
loader still hands over fp32, so the model does not hold the checkpoint twice while it casts."""

from __future__ import annotations

import pytest
import torch

import crescent.services.engine.kimi_k3.loading as loading
from crescent.kernels.mxfp4 import Mxfp4Tensor
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.loading import load_k3_model, save_hf_dir, seeded_weights
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.model.model_source import resolve_model
from tests.engine.k3_reference import TEST_CFG
from tests.engine.kimi_real_format import K3_CONFIG, KIMI_LINEAR_CONFIG, real_tensors, write_checkpoint

TOKENS = [5, 17, 300, 42, 7, 99, 250, 3, 11, 64, 128, 200, 31, 77, 411, 8, 19, 23]


def _handed_over(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The weights dicts the loader hands K3Model (the model is built as usual)."""
    seen: list[dict] = []

    def spy(cfg, weights, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(dict(weights))
        return K3Model(cfg, weights, **kwargs)

    monkeypatch.setattr(loading, "K3Model", spy)
    return seen


def _float_dtypes(weights: dict) -> set[torch.dtype]:
    return {t.dtype for t in weights.values() if not isinstance(t, Mxfp4Tensor)}


def _prefill(model: K3Model) -> torch.Tensor:
    torch.set_num_threads(1)
    engine = Engine(model, model_id="k3", kv_capacity_tokens=8 * 16, block_size=16)
    return engine.prefill(engine.add_sequence("a", TOKENS))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("k3-bf16")
    save_hf_dir(path, TEST_CFG, seeded_weights(TEST_CFG, 0), dtype=torch.bfloat16)
    return path


def test_a_bf16_checkpoint_reaches_a_bf16_model_in_bf16_with_the_same_bits(bf16_dir, monkeypatch) -> None:  # noqa: ANN001
    seen = _handed_over(monkeypatch)
    source = resolve_model(str(bf16_dir))
    bf16 = load_k3_model(source, dtype="bfloat16")
    fp32 = load_k3_model(source, dtype="float32")
    assert _float_dtypes(seen[0]) == {torch.bfloat16}  # no fp32 copy on the host
    assert _float_dtypes(seen[1]) == {torch.float32}   # fp32 compute: widened once, at load
    widened = K3Model(bf16.config, seen[1], dtype=torch.bfloat16)  # what the loader used to hand over
    assert torch.equal(_prefill(bf16), _prefill(widened))
    assert _prefill(fp32).dtype == torch.float32


@pytest.mark.parametrize("config", [K3_CONFIG, KIMI_LINEAR_CONFIG], ids=["kimi_k3 (mxfp4 experts)", "kimi_linear"])
def test_a_real_bf16_checkpoint_reaches_a_bf16_model_in_bf16(config, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Moonshot's layouts: renamed, reshaped and stacked tensors (experts, shared experts) keep the
    stored dtype too; A_log is stored in fp32 and computed from in fp32; dequantized MXFP4 is fp32."""
    seen = _handed_over(monkeypatch)
    source = resolve_model(str(write_checkpoint(tmp_path / "k3", config, real_tensors(config))))
    bf16 = load_k3_model(source, dtype="bfloat16", mxfp4_experts="packed")
    load_k3_model(source, dtype="float32")
    kept, widened = seen
    stored_fp32 = ("A_log", "dt_bias")  # real_tensors stores these in fp32, and the latent projections
    mxfp4_non_expert = ("mlp.latent_down.weight", "mlp.latent_up.weight")  # of K3 in MXFP4: dequantized to fp32
    not_bf16 = {n for n, t in kept.items() if not isinstance(t, Mxfp4Tensor) and t.dtype != torch.bfloat16}
    assert all(kept[n].dtype == torch.float32 and n.endswith(stored_fp32 + mxfp4_non_expert) for n in not_bf16)
    assert len(not_bf16) < len(kept) // 4
    stacked = [n for n in kept if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked and all(isinstance(kept[n], Mxfp4Tensor) or kept[n].dtype == torch.bfloat16 for n in stacked)
    assert _float_dtypes(widened) == {torch.float32}
    for name, t in kept.items():  # the same values, the same bits once the model casts them
        if not isinstance(t, Mxfp4Tensor):
            assert torch.equal(t.to(torch.bfloat16), widened[name].to(torch.bfloat16)), name
    assert _prefill(bf16).dtype == torch.float32  # the model runs from what it was handed
