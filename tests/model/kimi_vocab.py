"""Where the tests find Kimi's vocabulary (read from ../shared/, never committed), and the mark
that skips a test module without it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"
needs_vocabulary = pytest.mark.skipif(
    not (SHARED / "tiktoken.model").is_file(),
    reason=f"the Kimi vocabulary is not at {SHARED} (it is read from ../shared/, never committed)",
)


# Kimi K3's tokenizer_config.json names these ids (public references: vLLM's and SGLang's K3
# parsers, K3 tokenizer ports); the rest of its 256 reserved ids are named as in K2's.
K3_NAMES = {"163586": ("<|end_of_msg|>", True), "163587": ("<|open|>", False), "163588": ("<|close|>", False),
            "163589": ("<|sep|>", False)}


def write_k3_checkpoint(directory: Path, *, model_type: str = "kimi_k3", template: str | None = None) -> Path:
    """A K3-format checkpoint directory without weights: config.json (as transformers writes a
    nested K3 config), Kimi's vocabulary and a tokenizer_config.json with K3's special-token names,
    and optionally a ``chat_template.jinja``."""
    directory.mkdir(parents=True, exist_ok=True)
    os.symlink(SHARED / "tiktoken.model", directory / "tiktoken.model")
    config = json.loads((SHARED / "tokenizer_config.json").read_text(encoding="utf-8"))
    table = config["added_tokens_decoder"]
    for token_id, (content, special) in K3_NAMES.items():
        table[token_id] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": special}
    config["eos_token"] = "<|end_of_msg|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": model_type,
        "text_config": {"model_type": model_type, "vocab_size": 163840, "eos_token_id": 163586},
    }), encoding="utf-8")
    if template is not None:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return directory
