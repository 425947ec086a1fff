"""What every Hugging Face ``config.json`` holds besides the model's own fields, read one way.

transformers writes a ``config.json`` (and each nested ``text_config``/``vision_config``) from
``PretrainedConfig.to_dict``: the model's own fields plus the *generic* ones every config has
(``add_cross_attention``, ``id2label``, ``top_k``, ``torchscript``, ``use_bfloat16`` … 56 in
transformers 4.57, 13 in 5.x). ``GENERIC_FIELDS`` names them, so a config reader can ignore them
*by name* and still refuse a model-specific field it does not know. The list is the union of
what ``PretrainedConfig().to_dict()`` writes in transformers 4.57.1 and 5.25.0 (captured by
``scripts/capture_hf_config_fields.py`` into ``tests/fixtures/hf_config/``; a test checks the two
agree) plus ``torch_dtype``, the dtype key before 4.56.

The context window — one function for gateway, engine and ``crescent plan``: the smallest of the
length keys vLLM reads (``vllm.config``'s ``_get_and_verify_max_len``: ``max_position_embeddings``,
``n_positions``, ``max_seq_len``, ``seq_length``, ``model_max_length``, ``max_target_positions``,
``max_sequence_length``, ``max_seq_length``, ``seq_len``) in the text config (``text_config`` when
nested) and the top level. Kimi-Linear says only ``model_max_length: 1048576`` (MLA has no
positions). ``max_length`` is a *generation* default (20), never a length key.

The config's dtype: ``dtype`` (transformers ≥ 4.56) or ``torch_dtype``, the text config's first.
Torch-free: the gateway imports it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# PretrainedConfig.to_dict() in transformers 4.57.1 (56 names) and 5.25.0 (13, all among them),
# plus torch_dtype (written until 4.56). Some are *used* by a model reader (bos/eos/pad ids,
# tie_word_embeddings, dtype): a reader takes those it needs before ignoring the rest.
GENERIC_FIELDS: frozenset[str] = frozenset({
    "_name_or_path", "add_cross_attention", "architectures", "bad_words_ids", "begin_suppress_tokens",
    "bos_token_id", "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id",
    "diversity_penalty", "do_sample", "dtype", "early_stopping", "encoder_no_repeat_ngram_size",
    "eos_token_id", "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty",
    "max_length", "min_length", "model_type", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores", "pad_token_id",
    "prefix", "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params", "temperature",
    "tf_legacy_loss", "tie_encoder_decoder", "tie_word_embeddings", "tokenizer_class", "top_k", "top_p",
    "torchscript", "transformers_version", "typical_p", "use_bfloat16", "torch_dtype",
})

# Generic fields that would change a decoder-only model if set: ignored only at these values.
_GENERIC_DEFAULTS: dict[str, Any] = {
    "add_cross_attention": False, "is_encoder_decoder": False, "tie_encoder_decoder": False, "pruned_heads": {},
}

# vLLM's length keys, in its order; the smallest present wins.
LENGTH_KEYS: tuple[str, ...] = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)
# When a config names no length at all (vLLM assumes 2048 and warns; Crescent's gateway said
# 8192, SmolLM2's window): one default for every component.
DEFAULT_CONTEXT_WINDOW = 8192
DTYPE_KEYS = ("dtype", "torch_dtype")


class HfConfigError(ValueError):
    """A config.json value that cannot be served; the message names the field."""


def text_config(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The text model's config and where it sits (``"text_config."`` or ``""``)."""
    nested = raw.get("text_config")
    return (nested, "text_config.") if isinstance(nested, Mapping) else (raw, "")


def check_generic(cfg: Mapping[str, Any], where: str = "") -> None:
    """Refuse a generic field set to a value that makes the config something other than a plain
    decoder (cross-attention, an encoder-decoder, pruned heads)."""
    for key, default in _GENERIC_DEFAULTS.items():
        if key in cfg and cfg[key] not in (default, None):
            raise HfConfigError(f"config.json {where}{key} = {cfg[key]!r} is not supported (only {default!r})")


def _length(cfg: Mapping[str, Any], where: str) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for key in LENGTH_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise HfConfigError(f"config.json {where}{key} = {value!r} is not a positive length")
        if best is None or int(value) < best[0]:
            best = (int(value), where + key)
    return best


def config_context_window(raw: Mapping[str, Any]) -> tuple[int, str] | None:
    """The model's context window and the key it came from, or None when no length key is set:
    the smallest length key of the text config and of the top level (as vLLM reads them)."""
    text, where = text_config(raw)
    found = [f for f in (_length(text, where), _length(raw, "") if where else None) if f is not None]
    return min(found) if found else None


def context_window(raw: Mapping[str, Any]) -> int:
    """``config_context_window``, or ``DEFAULT_CONTEXT_WINDOW`` when the config names none."""
    found = config_context_window(raw)
    return DEFAULT_CONTEXT_WINDOW if found is None else found[0]


def read_config_json(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict (``OSError``/``ValueError`` for a missing or malformed one)."""
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object")
    return raw


def dir_context_window(path: Path) -> int:
    """The context window of a model directory: what every component serves it with."""
    found = config_context_window(read_config_json(path))
    if found is None:
        log.warning("%s: config.json names no length key (%s): context window %d tokens",
                    path, ", ".join(LENGTH_KEYS), DEFAULT_CONTEXT_WINDOW)
        return DEFAULT_CONTEXT_WINDOW
    return found[0]


def config_dtype(raw: Mapping[str, Any]) -> tuple[str, str] | None:
    """The dtype name the config states (``torch.`` prefix dropped) and its key, text config
    first; None when it states none."""
    text, where = text_config(raw)
    for cfg, prefix in ((text, where), (raw, "")) if where else ((raw, ""),):
        for key in DTYPE_KEYS:
            if cfg.get(key) is not None:
                return str(cfg[key]).removeprefix("torch."), prefix + key
    return None
