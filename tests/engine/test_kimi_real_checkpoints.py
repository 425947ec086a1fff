"""Real Kimi checkpoint formats load and compute the public modeling code's logits.

Tiny checkpoints written here in exactly the real formats (``kimi_k3`` nested with MXFP4
experts and vision tensors, ``kimi_linear`` flat, see kimi_real_format.py) are served through
the Engine — prefill, decode across a block boundary, a prefix hit — and every logit row is held
to an independent reference written from Moonshot's modeling code (kimi_real_reference.py).
Each runs twice: with the checkpoint's own cache dtype (its ``torch_dtype``, bf16: MLA latents and
conv tails stored in bf16, the reference rounding the same values at the same points) and with
the ``float32`` override (fp32 rounding). Negative controls show the tolerance would catch each
config-chosen numeric being wrong, and the bf16 storage not being modeled; bad configs fail
naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.hf_formats import parse_real_config
from crescent.services.engine.kimi_k3.loading import load_k3_model, load_real_weights
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.weights import weight_shapes
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.instance.runtime import build_engine
from crescent.services.engine.settings import EngineSettings
from crescent.services.model.model_source import resolve_model
from tests.engine.kimi_real_format import (
    K3_CONFIG, KIMI_LINEAR_CONFIG, real_tensors, reference_weights, text_config, with_changes, write_checkpoint,
)
from tests.engine.kimi_real_reference import Storage, reference_logits

PAGE = 16
# Relative L2 error of a logit row against the float64 reference. Measured: 5e-7..2e-5; the fp32
# reference itself is up to 8e-5 off on the tiny K3 checkpoint, so this is fp32 rounding.
TOLERANCE = 5e-5
# With a bf16 cache the reference rounds what the engine stores, but where a stored value lies
# within the fp32 engine's own error of a bf16 rounding tie, the two round it apart (one bf16 ulp;
# measured on the tiny K3 checkpoint, whose fp32 error is the larger: 3 of 1,600 latents in its
# first MLA layer, 18 in its second). Measured: K3 up to 1.6e-4, Kimi-Linear 1.4e-6 — both far
# below what bf16 storage itself moves the logits (7e-3 and 2e-3 on the last row: ``test_bf16_storage_is_modeled``).
BF16_TOLERANCE = {"kimi_k3": 5e-4, "kimi_linear": TOLERANCE}
CONFIGS = {"kimi_k3": K3_CONFIG, "kimi_linear": KIMI_LINEAR_CONFIG}
CACHES = ["checkpoint", "float32"]  # the checkpoint's torch_dtype (bf16), or the fp32 override


@functools.cache
def _checkpoint(kind: str, root: Path) -> Path:
    return write_checkpoint(root / kind, CONFIGS[kind], real_tensors(CONFIGS[kind]))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kimi-real")


@functools.cache
def _model(path: Path, cache: str = "checkpoint") -> K3Model:
    return load_k3_model(resolve_model(str(path)), cache_dtype=None if cache == "checkpoint" else cache)


@functools.cache
def _reference(path: Path, kind: str, tokens: tuple[int, ...], storage: Storage | None = None) -> torch.Tensor:
    return reference_logits(text_config(CONFIGS[kind]), reference_weights(path), list(tokens), storage)


def _expected(path: Path, kind: str, cache: str, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """The reference logits for this cache, and the tolerance to hold the engine to."""
    if cache == "float32":
        return _reference(path, kind, tuple(tokens)), TOLERANCE
    assert _model(path, cache).config.cache_dtype == "bfloat16"  # the checkpoints' torch_dtype
    return _reference(path, kind, tuple(tokens), Storage(torch.bfloat16, PAGE)), BF16_TOLERANCE[kind]


def _engine(model: K3Model) -> Engine:
    torch.set_num_threads(1)
    return Engine(model, model_id="kimi-real", kv_capacity_tokens=16 * PAGE, block_size=PAGE)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", CONFIGS)
def test_prefill_and_decode_match_the_modeling_code(kind: str, cache: str, root: Path):
    path = _checkpoint(kind, root)
    tokens = _prompt(40, seed=1)
    reference, tolerance = _expected(path, kind, cache, tokens)
    engine = _engine(_model(path, cache))
    seq = engine.add_sequence("a", tokens[:29])  # one full block and a partial one
    assert rel_err(engine.prefill(seq), reference[28]) < tolerance
    for i in range(29, len(tokens)):  # decode token by token, across the block boundary at 32
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < tolerance, f"position {i}"


def _prefill_and_decode(engine: Engine, tokens: list[int], decode: int,
                        *, use_cache: bool = True) -> tuple[int, list[torch.Tensor]]:
    """Prefill all but the last ``decode`` tokens, then decode those one by one: (tokens taken
    from the cache, every logit row)."""
    seq = engine.add_sequence("s", tokens[:-decode], use_cache=use_cache)
    rows = [engine.prefill(seq)]
    for token in tokens[-decode:]:
        seq.token_ids.append(token)
        rows.append(engine.decode_step([seq])[0])
    return seq.num_cached, rows


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", CONFIGS)
def test_a_prefix_hit_gives_the_modeling_code_logits(kind: str, cache: str, root: Path):
    path = _checkpoint(kind, root)
    engine = _engine(_model(path, cache))
    first = engine.add_sequence("a", _prompt(40, seed=1))
    engine.prefill(first)
    engine.release(first)
    tokens = _prompt(40, seed=1)[:2 * PAGE] + _prompt(9, seed=2)
    reference, tolerance = _expected(path, kind, cache, tokens)
    cached, warm = _prefill_and_decode(engine, tokens, 3)
    assert cached == 2 * PAGE  # resumed from the block-boundary state snapshot
    for row, i in zip(warm, range(len(tokens) - 4, len(tokens)), strict=True):
        assert rel_err(row, reference[i]) < tolerance, f"position {i}"
    # resumed and cold round the very same stored values: they agree to fp32 rounding, bf16 or not
    _, cold = _prefill_and_decode(_engine(_model(path, cache)), tokens, 3, use_cache=False)
    for row, cold_row in zip(warm, cold, strict=True):
        assert rel_err(row, cold_row.double()) < 1e-6


@pytest.mark.parametrize("kind", CONFIGS)
def test_bf16_storage_is_modeled(kind: str, root: Path):
    """The bf16 reference is not the fp32 one within the tolerance: the engine's match to it shows
    it stores (and rounds) latents and conv tails where the reference says, and nowhere else."""
    path = _checkpoint(kind, root)
    tokens = _prompt(40, seed=1)
    engine = _engine(_model(path))
    logits = engine.prefill(engine.add_sequence("a", tokens))
    tolerance = BF16_TOLERANCE[kind]
    assert rel_err(logits, _reference(path, kind, tuple(tokens), Storage(torch.bfloat16, PAGE))[-1]) < tolerance
    assert rel_err(logits, _reference(path, kind, tuple(tokens))[-1]) > 10 * tolerance  # fp32 storage
    every_token = Storage(torch.bfloat16, 1)  # conv tails rounded after every token, not per block
    assert rel_err(logits, _reference(path, kind, tuple(tokens), every_token)[-1]) > 10 * tolerance
    assert _model(path, "float32").config.cache_dtype == "float32"  # the override
    assert _engine(_model(path, "float32")).cache.latent.dtype == torch.float32
    assert engine.cache.latent.dtype == torch.bfloat16


# Each numeric the config chooses, set the other way on the same weights: the logits move far
# beyond the tolerance, so the tests above would catch any of them being computed wrong.
FLIPS = [
    ("kimi_k3", {"mla_rope": True}),                   # NoPE MLA
    ("kimi_k3", {"moe_latent_norm": False}),           # the latent norm between down and up
    ("kimi_k3", {"kda_lower_bound": None}),            # K3's lower-bounded decay gate
    ("kimi_k3", {"situ_beta_up": None}),               # SiTU's cap on the up projection
    ("kimi_k3", {"attn_res_block_layers": 3}),         # AttnRes blocks of attn_res_block_size layers
    ("kimi_linear", {"kda_lower_bound": -5.0}),        # Kimi-Linear's softplus decay gate
    ("kimi_linear", {"hidden_act": "situ"}),           # SiLU
]


@pytest.mark.parametrize(("kind", "change"), FLIPS, ids=[f"{k}-{next(iter(c))}" for k, c in FLIPS])
def test_each_config_chosen_numeric_matters(kind: str, change: dict, root: Path):
    path = _checkpoint(kind, root)
    tokens = _prompt(20, seed=3)
    model = _model(path)
    weights = load_real_weights(path, model.config, parse_real_config(CONFIGS[kind])[1])
    config = dataclasses.replace(model.config, **change)
    flipped = K3Model(config, {name: weights[name] for name in weight_shapes(config)})
    engine = _engine(flipped)
    logits = engine.prefill(engine.add_sequence("a", tokens))
    assert rel_err(logits, _reference(path, kind, tuple(tokens))[-1]) > 100 * TOLERANCE


def test_configs_translate_to_the_real_numerics():
    k3, fmt = parse_real_config(K3_CONFIG)
    assert (fmt.prefix, fmt.compressed_mxfp4) == ("language_model.", True)
    assert k3.layer_types == ("kda", "kda", "kda", "mla", "kda", "kda", "mla")
    assert (k3.mla_rope, k3.mla_output_gate, k3.kda_full_rank_output_gate, k3.kda_lower_bound) == (False, True, True, -5.0)
    assert (k3.attn_res, k3.sublayers_per_block, k3.hidden_act, k3.situ_beta_up) == (True, 4, "situ", 25.0)
    assert (k3.moe_latent_size, k3.moe_latent_norm, k3.shared_intermediate_size) == (32, True, 2 * 32)
    assert (k3.rms_norm_eps, k3.mla_latent_norm_eps, k3.q_lora_rank) == (1e-5, 1e-6, 32)
    linear, fmt = parse_real_config(KIMI_LINEAR_CONFIG)
    assert (fmt.prefix, fmt.compressed_mxfp4) == ("", False)
    assert (linear.attn_res, linear.hidden_act, linear.kda_lower_bound, linear.kda_full_rank_output_gate) == (
        False, "silu", None, False)
    assert (linear.moe_latent_size, linear.q_lora_rank, linear.mla_output_gate, linear.mla_rope) == (0, 0, False, False)
    assert linear.routed_scaling_factor == 2.446
    # the cache keeps latents and conv tails in the checkpoint's torch_dtype: the text config's, else the top level's
    assert k3.cache_dtype == linear.cache_dtype == "bfloat16"
    no_text_dtype = with_changes(K3_CONFIG, torch_dtype="float32")
    del no_text_dtype["text_config"]["torch_dtype"]
    assert parse_real_config(no_text_dtype)[0].cache_dtype == "float32"
    assert parse_real_config(with_changes(KIMI_LINEAR_CONFIG, {"torch_dtype": None}))[0].cache_dtype == "float32"


def test_vision_tensors_are_skipped_with_one_log_line(root: Path, caplog):
    with caplog.at_level(logging.INFO, logger="crescent.services.engine.kimi_k3"):
        load_k3_model(resolve_model(str(_checkpoint("kimi_k3", root))))
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1
    assert "skipping 2 vision-tower/projector tensors" in lines[0] and "text-only" in lines[0]


BAD_CONFIGS = [
    (with_changes(K3_CONFIG, vision_tokens_per_frame=4), "'vision_tokens_per_frame'"),
    (with_changes(K3_CONFIG, {"moe_expert_dropout": 0.1}), "'text_config.moe_expert_dropout'"),
    (with_changes(K3_CONFIG, {"linear_attn_config": {**K3_CONFIG["text_config"]["linear_attn_config"], "qk_norm": True}}),
     "'text_config.linear_attn_config.qk_norm'"),
    (with_changes(KIMI_LINEAR_CONFIG, {"swa_window": 128}), "'swa_window'"),
    (with_changes(KIMI_LINEAR_CONFIG, {"mla_use_nope": False}), "mla_use_nope"),
    (with_changes(KIMI_LINEAR_CONFIG, {"hidden_act": "gelu"}), "hidden_act"),
    (with_changes(K3_CONFIG, {"torch_dtype": "float8_e4m3fn"}), "text_config.torch_dtype"),
    (with_changes(K3_CONFIG, quantization_config={"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}),
     "quantization_config.format"),
]


@pytest.mark.parametrize(("config", "field"), BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_a_config_the_loader_does_not_understand_fails_naming_the_field(config: dict, field: str, tmp_path: Path):
    path = write_checkpoint(tmp_path / "bad", config, {"model.norm.weight": torch.ones(4)}, shards=1)
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        load_k3_model(resolve_model(str(path)))


@pytest.mark.parametrize("drop", ["language_model.model.layers.2.block_sparse_moe.routed_expert_norm.weight",
                                  "language_model.model.layers.5.self_attention_res_proj.weight",
                                  "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight_scale"])
def test_a_missing_tensor_is_named_as_the_checkpoint_stores_it(drop: str, tmp_path: Path):
    tensors = real_tensors(K3_CONFIG)
    del tensors[drop]
    path = write_checkpoint(tmp_path / "k3", K3_CONFIG, tensors)
    expected = drop.removesuffix("_scale") if drop.endswith("_scale") else drop
    with pytest.raises(ModelLoadError, match=expected.replace(".", r"\.").split("experts.7")[0]):
        load_k3_model(resolve_model(str(path)))


def test_a_padded_a_log_must_pad_with_zeros(tmp_path: Path):
    tensors = real_tensors(K3_CONFIG)
    tensors["language_model.model.layers.0.self_attn.A_log"][-1] = 0.5
    path = write_checkpoint(tmp_path / "k3", K3_CONFIG, tensors)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.A_log.*zero"):
        load_k3_model(resolve_model(str(path)))


@pytest.mark.parametrize(("setting", "dtype"), [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_the_engine_setting_chooses_the_cache_dtype(setting: str, dtype: torch.dtype, root: Path):
    engine = build_engine(EngineSettings(model=str(_checkpoint("kimi_k3", root)), kv_cache_dtype=setting,
                                         kv_capacity_tokens=4 * PAGE, block_size=PAGE, threads=1))
    assert engine.cache.latent.dtype == engine.cache.snapshots.states.tail.dtype == dtype
    assert engine.cache.snapshots.states.state.dtype == torch.float32  # KDA states: fp32 always
