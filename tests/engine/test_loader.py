"""Model loading: the default GGUF from the wheel, tiny hand-built GGUFs, the weight cache, HF export."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from crescent.services.engine.loader import (
    LoadedModel,
    ModelLoadError,
    UnsupportedTensorTypeError,
    cache,
    export_hf_dir,
    load_model,
)
from crescent.services.engine.loader.dequant import dequantize
from crescent.services.engine.model_config import LlamaConfig
from crescent.services.model.model_source import DEFAULT_MODEL, ModelSpecError, ModelSource, resolve_model

torch.set_num_threads(2)


def llama_cpp_permute(w: np.ndarray | torch.Tensor, n_head: int):
    """llama.cpp's converter permutation of Q/K rows (HF rotate-half → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("crescent-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CRESCENT_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def cold(cache_dir: Path, source: ModelSource) -> tuple[LoadedModel, float]:
    """The default model loaded from the GGUF into an empty cache (which this load fills)."""
    start = time.perf_counter()
    loaded = load_model(source, progress=False)
    return loaded, time.perf_counter() - start


@pytest.fixture(scope="module")
def model(cold: tuple[LoadedModel, float]) -> LoadedModel:
    return cold[0]


# --- the default model --------------------------------------------------------------------------

def test_default_preset_resolves_to_the_wheel_gguf(source: ModelSource) -> None:
    assert source.kind == "gguf" and source.model_id == DEFAULT_MODEL
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_config_matches_the_model_card(model: LoadedModel) -> None:
    c = model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2, 0))
    assert c.kv_bytes_per_token() == 46080
    assert model.model_id == DEFAULT_MODEL


def test_weights_have_hf_names_and_shapes(model: LoadedModel) -> None:
    shapes = {name: tuple(t.shape) for name, t in model.weights.items()}
    assert shapes == model.config.weight_shapes()
    assert "lm_head.weight" not in shapes  # tied to the embedding
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    for name, t in model.weights.items():
        assert t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous(), name
    assert all(bool(torch.isfinite(t).all()) for t in model.weights.values())


def test_q_and_k_rows_are_the_gguf_rows_unpermuted(model: LoadedModel, source: ModelSource) -> None:
    raw = {t.name: t for t in gguf.GGUFReader(str(source.path)).tensors}
    for layer in (0, 29):
        for kind, heads in (("q", 9), ("k", 3)):
            t = raw[f"blk.{layer}.attn_{kind}.weight"]
            stored = gguf.quants.dequantize(t.data, t.tensor_type)
            ours = model.weights[f"model.layers.{layer}.self_attn.{kind}_proj.weight"].numpy()
            np.testing.assert_array_equal(llama_cpp_permute(ours, heads), stored)
            assert not np.array_equal(ours, stored)


def reference_logits(w: dict[str, torch.Tensor], c: LlamaConfig, ids: list[int]) -> torch.Tensor:
    """A textbook Llama forward with Hugging Face rotate-half RoPE."""
    n, d = len(ids), c.head_dim
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    ang = torch.arange(n).float()[:, None] / c.rope_theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    def rms(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * g

    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, d).transpose(0, 1))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, d).transpose(0, 1))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, d).transpose(0, 1)
        group = c.num_heads // c.num_kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                           is_causal=True)
        x = x + a.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def test_loaded_weights_make_a_working_model(model: LoadedModel) -> None:
    """The RoPE check that matters: with rotate-half RoPE the model knows facts and text is likely."""
    tok, c = model.tokenizer, model.config
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt + "The capital of France is")
    with torch.inference_mode():
        assert tok.decode([int(reference_logits(model.weights, c, ids)[-1].argmax())]) == " Paris"
        text = tok.encode("The quick brown fox jumps over the lazy dog. "
                          "The capital of France is Paris, and the capital of Germany is Berlin.")
        nll = float(F.cross_entropy(reference_logits(model.weights, c, text)[:-1], torch.tensor(text[1:])))
    # Measured: 2.6 nats/token; with Q/K left in llama.cpp's row order it is 3.8.
    assert nll < 3.2


def test_cache_hit_is_identical_and_faster(cold: tuple[LoadedModel, float], source: ModelSource,
                                           cache_dir: Path) -> None:
    first, cold_s = cold
    entries = list((cache_dir / "weights").iterdir())
    assert [e.name for e in entries] == [cache.entry_dir(source.path).name]  # no temp dirs left
    start = time.perf_counter()
    again = load_model(source, progress=False)
    warm_s = time.perf_counter() - start
    assert again.config == first.config and again.model_id == first.model_id
    assert again.weights.keys() == first.weights.keys()
    assert all(torch.equal(again.weights[n], first.weights[n]) for n in first.weights)
    text = "<|im_start|>user\nHé 🎉 12<|im_end|>"
    assert again.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert again.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert again.tokenizer.chat_template == first.tokenizer.chat_template
    assert warm_s < cold_s / 4, (warm_s, cold_s)


def test_hf_export_round_trip(model: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "SmolLM2-135M-f32"
    export_hf_dir(model, out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tcfg["chat_template"]
    src = resolve_model(str(out))
    assert (src.kind, src.model_id) == ("hf", "SmolLM2-135M-f32")
    again = load_model(src, progress=False)
    assert again.config == model.config
    assert again.weights.keys() == model.weights.keys()
    assert all(torch.equal(again.weights[n], model.weights[n]) for n in model.weights)
    for text in ["Hello, world!", "naïve café 日本語 🎉", "<|im_start|>system\n42<|im_end|>"]:
        assert again.tokenizer.encode(text) == model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert again.tokenizer.apply_chat_template(messages) == model.tokenizer.apply_chat_template(messages)


# --- tiny hand-built GGUFs: every supported tensor type, errors, cache invalidation -------------

TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he"]
TINY = LlamaConfig(vocab_size=len(TINY_TOKENS), hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2, 0))
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Worst-case error per type for values in [-1, 1]: half a quantization step, plus fp16 scales.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1 / 127 / 2 + 1e-3, Q.Q4_1: 2 / 15 / 2 + 2e-3}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def tiny_type(hf: str) -> Q:
    if hf.endswith("norm.weight"):
        return Q.F32
    if "q_proj" in hf or "up_proj" in hf:
        return Q.Q4_1
    if "k_proj" in hf or "lm_head" in hf or "down_proj" in hf:
        return Q.F16
    return Q.Q8_0  # embedding, v, o, gate


def write_tiny_gguf(path: Path, overrides: dict[str, Q] | None = None) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF in llama.cpp's layout; returns the HF-layout weights it encodes."""
    rng = np.random.default_rng(0)
    weights = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in TINY.weight_shapes().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("attention.head_count", 4), ("attention.head_count_kv", 2)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TINY_TOKENS)
    w.add_token_merges(["h e"])
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TINY_TOKENS) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, value in weights.items():
        if "q_proj" in name:
            value = llama_cpp_permute(value, TINY.num_heads)
        elif "k_proj" in name:
            value = llama_cpp_permute(value, TINY.num_kv_heads)
        qtype = (overrides or {}).get(name, tiny_type(name))
        if qtype == Q.F32:
            w.add_tensor(gguf_name(name), value)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.fixture()
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelSource, dict[str, np.ndarray]]:
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    weights = write_tiny_gguf(path)
    return resolve_model(str(path)), weights


def test_every_supported_type_loads_within_its_precision(tiny: tuple[ModelSource, dict[str, np.ndarray]]) -> None:
    src, expected = tiny
    loaded = load_model(src, progress=True, use_cache=False)
    assert loaded.config == TINY
    assert loaded.weights.keys() == expected.keys()  # untied: lm_head present
    for name, want in expected.items():
        err = float(np.abs(loaded.weights[name].numpy() - want).max())
        assert err <= TOLERANCE[tiny_type(name)], (name, tiny_type(name).name, err)


def test_unsupported_tensor_type_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, overrides={"model.layers.1.mlp.gate_proj.weight": Q.Q5_0})
    with pytest.raises(UnsupportedTensorTypeError, match=r"'blk\.1\.ffn_gate\.weight' is stored as Q5_0"):
        load_model(resolve_model(str(path)), progress=False, use_cache=False)


def test_cache_follows_file_changes_and_survives_corruption(
    tiny: tuple[ModelSource, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    src, _ = tiny
    first = load_model(src, progress=False)
    old_entry = cache.entry_dir(src.path)
    assert (old_entry / "model.safetensors").is_file()
    os.utime(src.path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file "changed"
    new_entry = cache.entry_dir(src.path)
    assert new_entry != old_entry
    load_model(src, progress=False)
    assert new_entry.is_dir() and not old_entry.exists()  # stale entry pruned
    (new_entry / "model.safetensors").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        again = load_model(src, progress=False)
    assert "unusable" in caplog.text
    assert all(torch.equal(again.weights[n], first.weights[n]) for n in first.weights)


def test_sharded_bf16_hf_checkpoint(tiny: tuple[ModelSource, dict[str, np.ndarray]], tmp_path: Path) -> None:
    src, _ = tiny
    loaded = load_model(src, progress=False, use_cache=False)
    out = tmp_path / "tiny-hf"
    export_hf_dir(loaded, out)
    (out / "model.safetensors").unlink()
    names = sorted(loaded.weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: loaded.weights[n].to(torch.bfloat16) for n in shard_names}, str(out / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    again = load_model(resolve_model(str(out)), progress=False)
    assert again.config == loaded.config
    assert again.torch_dtype == torch.float32  # what export_hf_dir declared; the shards hold bf16
    for name, t in loaded.weights.items():
        assert again.weights[name].dtype == torch.bfloat16  # as stored: the model converts to engine.dtype
        assert torch.equal(again.weights[name], t.to(torch.bfloat16)), name
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(ModelSource("hf", out, "tiny-hf"), progress=False)


# --- dequantization against hand-computed blocks ------------------------------------------------

def test_q8_0_block() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), q.view(np.uint8)])
    out = dequantize("t", block.reshape(1, 34), Q.Q8_0, (1, 32))
    np.testing.assert_array_equal(out, 0.5 * np.arange(-16, 16, dtype=np.float32)[None])


def test_q4_1_block() -> None:
    # 32 weights = d * nibble + m; byte j holds weight j (low nibble) and weight j + 16 (high nibble).
    lo, hi = np.arange(16), 15 - np.arange(16)
    scales = np.array([0.25, -1.0], np.float16).view(np.uint8)
    block = np.concatenate([scales, (lo | (hi << 4)).astype(np.uint8)])
    out = dequantize("t", block.reshape(1, 20), Q.Q4_1, (1, 32))
    np.testing.assert_array_equal(out[0, :16], 0.25 * lo - 1.0)
    np.testing.assert_array_equal(out[0, 16:], 0.25 * hi - 1.0)


def test_f16_and_f32() -> None:
    values = np.array([[1.5, -2.25], [65504.0, 2.0**-14]], np.float16)
    np.testing.assert_array_equal(dequantize("t", values, Q.F16, (2, 2)), values.astype(np.float32))
    f32 = np.array([3.0, -0.1], np.float32)
    np.testing.assert_array_equal(dequantize("t", f32, Q.F32, (2,)), f32)


def test_dequantize_rejects_other_types_by_name() -> None:
    with pytest.raises(UnsupportedTensorTypeError, match="'blk.3.ffn_up.weight' is stored as Q4_K.*Q4_1"):
        dequantize("blk.3.ffn_up.weight", np.zeros((1, 144), np.uint8), Q.Q4_K, (1, 256))


# --- model specs --------------------------------------------------------------------------------

def test_unknown_model_spec_lists_valid_forms(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError) as info:
        resolve_model("gpt-17-ultra")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'gpt-17-ultra'" in message and DEFAULT_MODEL in message and ".gguf" in message
    assert "config.json" in message
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match=r"missing tokenizer\.json, \*\.safetensors"):
        resolve_model(str(tmp_path))
