"""What vLLM loads for a Crescent model setting: a Hugging Face directory.

A directory is used as it is. A preset or a GGUF file (the embedded default) is exported once by
Crescent's own loader into a float32 Hugging Face directory under the user's cache, so both
backends serve the very same weights; later starts reuse it. The model id stays Crescent's (the
preset's name), so block keys and placement are the same whichever backend computes.
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from crescent.services.model.model_source import ModelSource, resolve_model

log = logging.getLogger(__name__)

EXPORT_DONE = ".crescent-export-done"


@dataclass(frozen=True, slots=True)
class VllmModel:
    model_id: str
    directory: Path


def cache_root() -> Path:
    return Path(os.environ.get("CRESCENT_VLLM_MODELS", Path.home() / ".cache" / "crescent" / "vllm-models"))


def vllm_model(spec: str) -> VllmModel:
    source = resolve_model(spec)
    if source.kind == "hf" or (source.kind == "kimi_k3" and source.path.is_dir()):
        return VllmModel(source.model_id, source.path)
    if source.kind == "kimi_k3":
        raise ValueError(f"{spec!r} is a seeded Crescent preset with no checkpoint on disk; the vLLM backend "
                         "serves checkpoints (a Hugging Face directory)")
    return VllmModel(source.model_id, _exported(source))


def _exported(source: ModelSource) -> Path:
    out = cache_root() / source.model_id
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several instances starting at once export it once
        if not (out / EXPORT_DONE).exists():
            from crescent.services.engine.loader import export_hf_dir, load_model

            log.info("exporting %s to a Hugging Face directory for vLLM: %s", source.model_id, out)
            export_hf_dir(load_model(source, progress=False), out)
            (out / EXPORT_DONE).write_text(str(source.path))
    return out
