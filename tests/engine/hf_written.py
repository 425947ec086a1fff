"""Configs as transformers writes them: the model's own fields plus every generic field.

``tests/fixtures/hf_config/transformers-<version>.json`` is ``PretrainedConfig().to_dict()`` as
captured from transformers itself (``scripts/capture_hf_config_fields.py``) — not a list Crescent
wrote — so a fixture built here carries exactly what a ``save_pretrained`` checkpoint carries:
``add_cross_attention``, ``id2label``, ``top_k``, ``torchscript``, ``use_bfloat16``, ``max_length``
(a generation default, never a length key), ``dtype``..., at the top level and in every nested
``text_config``/``vision_config``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf_config"
VERSIONS = tuple(sorted(p.stem.removeprefix("transformers-") for p in FIXTURES.glob("transformers-*.json")))
DEFAULT_VERSION = "4.57.1"  # 56 generic fields, the ones the issue saw in a real K3 config


def generic_fields(version: str = DEFAULT_VERSION) -> dict[str, Any]:
    return json.loads((FIXTURES / f"transformers-{version}.json").read_text(encoding="utf-8"))


def as_written(fields: dict[str, Any], version: str = DEFAULT_VERSION) -> dict[str, Any]:
    """``fields`` (a model's own config keys) with the generic ones transformers adds to it."""
    return {**copy.deepcopy(generic_fields(version)), **copy.deepcopy(fields)}


def composite_as_written(top: dict[str, Any], text: dict[str, Any], vision: dict[str, Any],
                         version: str = DEFAULT_VERSION) -> dict[str, Any]:
    """A multimodal config (K3's): generic fields at the top and in both nested configs."""
    return {**as_written(top, version), "text_config": as_written(text, version),
            "vision_config": as_written(vision, version)}
