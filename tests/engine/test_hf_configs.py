"""Configs as checkpoints ship them: every field transformers writes, one context window, the dtype.

The fixtures are built from what transformers itself writes (``hf_written``: ``PretrainedConfig``'s
generic fields captured from transformers 4.57.1 and 5.25.0), at the top level and in K3's nested
``text_config``/``vision_config`` — not from the fields Crescent reads.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from crescent.services.engine.kimi_k3.hf_formats import parse_real_config
from crescent.services.engine.kimi_k3.loading import load_k3_model, read_any_config
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.model_config import LlamaConfig, ModelConfigError
from crescent.services.gateway.config import GatewaySettings
from crescent.services.gateway.model import load_served_model
from crescent.services.model.hf_config import (
    DEFAULT_CONTEXT_WINDOW, GENERIC_FIELDS, HfConfigError, config_context_window, context_window,
)
from crescent.services.model.model_source import resolve_model
from tests.engine.hf_written import VERSIONS, as_written, composite_as_written, generic_fields
from tests.engine.kimi_real_format import (
    K3_CONFIG, K3_TEXT, K3_VISION, KIMI_LINEAR_CONFIG, real_tensors, with_changes, write_checkpoint,
)

K3_TOP = {k: v for k, v in K3_CONFIG.items() if k not in ("text_config", "vision_config") and k not in generic_fields()}
K3_TOP |= {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "torch_dtype": "bfloat16"}
LINEAR_OWN = {k: v for k, v in KIMI_LINEAR_CONFIG.items() if k not in generic_fields()} | {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False}


def test_both_captured_transformers_versions_are_present() -> None:
    assert set(VERSIONS) >= {"4.57.1", "5.25.0"}
    assert len(generic_fields("4.57.1")) == 56  # add_cross_attention, id2label, top_k, torchscript, ...


@pytest.mark.parametrize("version", VERSIONS)
def test_every_generic_field_transformers_writes_is_known_by_name(version: str) -> None:
    assert set(generic_fields(version)) <= GENERIC_FIELDS


def test_the_live_transformers_writes_no_field_the_list_lacks() -> None:
    transformers = pytest.importorskip("transformers")  # not a dependency: checked where installed
    assert set(transformers.PretrainedConfig().to_dict()) <= GENERIC_FIELDS


@pytest.mark.parametrize("version", VERSIONS)
def test_real_configs_as_each_transformers_version_writes_them_parse_alike(version: str) -> None:
    k3 = composite_as_written(K3_TOP, K3_TEXT, K3_VISION, version)
    assert "add_cross_attention" in k3["text_config"] or version.startswith("5")
    assert parse_real_config(k3)[0] == parse_real_config(K3_CONFIG)[0]
    linear = as_written(LINEAR_OWN, version)
    assert parse_real_config(linear)[0] == parse_real_config(KIMI_LINEAR_CONFIG)[0]


@pytest.mark.parametrize("config,field", [
    (with_changes(K3_CONFIG, {"moe_expert_dropout": 0.1}), "'text_config.moe_expert_dropout'"),  # model-specific
    (with_changes(K3_CONFIG, moe_expert_dropout=0.1), "'moe_expert_dropout'"),
    (with_changes(KIMI_LINEAR_CONFIG, {"swa_window": 128}), "'swa_window'"),
    # generic, but it would make the model something else
    (with_changes(K3_CONFIG, {"add_cross_attention": True}), "text_config.add_cross_attention"),
    (with_changes(KIMI_LINEAR_CONFIG, {"pruned_heads": {"0": [1]}}), "pruned_heads"),
    (with_changes(KIMI_LINEAR_CONFIG, {"model_max_length": "long"}), "model_max_length"),
])
def test_an_unknown_model_field_is_still_an_error_naming_it(config: dict, field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        parse_real_config(config)


# ---- one context window ------------------------------------------------------------------------

def test_the_context_window_is_the_smallest_length_key_vllm_reads() -> None:
    assert config_context_window(KIMI_LINEAR_CONFIG) == (1_048_576, "model_max_length")
    assert "max_position_embeddings" not in KIMI_LINEAR_CONFIG and KIMI_LINEAR_CONFIG["max_length"] == 20
    assert config_context_window(K3_CONFIG) == (4096, "text_config.max_position_embeddings")
    assert config_context_window({"n_positions": 2048, "seq_length": 1024}) == (1024, "seq_length")
    nested = {"model_max_length": 512, "text_config": {"max_position_embeddings": 4096}}
    assert config_context_window(nested) == (512, "model_max_length")
    assert context_window(as_written({"model_type": "x"})) == DEFAULT_CONTEXT_WINDOW  # max_length: 20 is no length key
    with pytest.raises(HfConfigError, match="seq_len"):
        context_window({"seq_len": True})


def test_a_llama_config_takes_its_window_from_model_max_length() -> None:
    cfg = as_written({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 4, "model_max_length": 65536})
    assert LlamaConfig.from_hf_dict(cfg).max_position_embeddings == 65536


@functools.cache
def _kimi_linear_dir(root: Path, dtype: str = "bfloat16", config_dtype: bool = True) -> Path:
    config = with_changes(KIMI_LINEAR_CONFIG, {"torch_dtype": "bfloat16" if config_dtype else None, "dtype": None})
    tensors = {n: t.to(getattr(torch, dtype)) if t.is_floating_point() else t
               for n, t in real_tensors(KIMI_LINEAR_CONFIG).items()}
    return write_checkpoint(root / f"kl-{dtype}-{config_dtype}", config, tensors, shards=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-configs")


def test_gateway_engine_scheduler_and_plan_serve_one_context_window(root: Path) -> None:
    from tests.plan.test_plan_cli import plan

    from crescent.services.engine.settings import EngineSettings
    from crescent.services.instance.runtime import build_engine
    from crescent.services.instance.shell import NativeBackend

    path = _kimi_linear_dir(root)
    engine = build_engine(EngineSettings(model=str(path), kv_capacity_tokens=256, block_size=16, threads=1),
                          progress=False)
    engine_window = engine.config.max_position_embeddings
    registered = NativeBackend(engine).context_window  # what the engine registers; the scheduler checks agreement
    gateway_window = load_served_model(GatewaySettings(model=str(path))).context_window
    code, figures, _ = plan("--model", str(path), "--gpus", "H100")  # the default context: the model's window
    assert engine_window == registered == gateway_window == figures["sequence"]["context_tokens"] == 1_048_576
    assert plan("--model", str(path), "--gpus", "8xH100", "--context", "1M")[0] == 0


# ---- the model's dtype ---------------------------------------------------------------------------

@pytest.mark.parametrize("stored,expected", [("bfloat16", "bfloat16"), ("float32", "float32")])
def test_a_config_without_a_dtype_takes_the_weights_dtype(root: Path, stored: str, expected: str) -> None:
    path = _kimi_linear_dir(root, stored, config_dtype=False)
    assert json.loads((path / "config.json").read_text())["dtype"] is None  # as transformers writes "unset"
    assert read_any_config(path)[0].cache_dtype == expected
    assert load_k3_model(resolve_model(str(path))).make_cache(2, 16).latent.dtype == getattr(torch, expected)


def test_a_stated_dtype_wins_and_a_bad_one_is_named(root: Path) -> None:
    assert read_any_config(_kimi_linear_dir(root, "float32", config_dtype=True))[0].cache_dtype == "bfloat16"
    bad = root / "bad-dtype"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(with_changes(KIMI_LINEAR_CONFIG, {"dtype": "int8"})))
    with pytest.raises(ModelLoadError, match="dtype"):
        read_any_config(bad)
