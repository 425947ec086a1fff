"""Model loading: GGUF files and Hugging Face directories → weights (as stored), config, tokenizer.

``load_model(resolve_model(spec))`` is the entry point. GGUF loads are cached on disk as
float32 safetensors (see ``cache``), so only the first process pays for dequantization.
"""

from __future__ import annotations

from crescent.services.engine.loader import cache
from crescent.services.engine.loader.errors import ModelLoadError, UnsupportedTensorTypeError
from crescent.services.engine.loader.export import export_hf_dir
from crescent.services.engine.loader.gguf_loader import load_gguf
from crescent.services.engine.loader.hf_loader import load_hf_dir
from crescent.services.engine.loader.loaded import LoadedModel
from crescent.services.model.model_source import ModelSource

__all__ = ["LoadedModel", "ModelLoadError", "UnsupportedTensorTypeError", "export_hf_dir", "load_model"]


def load_model(source: ModelSource, *, progress: bool = True, use_cache: bool = True) -> LoadedModel:
    """Load weights (CPU, Hugging Face names; a checkpoint's dtype, a GGUF's dequantized to
    float32), config and tokenizer of ``source``.

    ``use_cache=False`` skips the GGUF weight cache both ways (read and write).
    """
    if source.kind == "hf":
        return load_hf_dir(source.path, source.model_id, progress=progress)
    if use_cache and (hit := cache.load_cached(source.path, source.model_id)) is not None:
        return hit
    loaded = load_gguf(source.path, source.model_id, progress=progress)
    if use_cache:
        cache.store(source.path, loaded)
    return loaded
