"""Errors raised while loading a model; both are ValueErrors that name the offending part."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded; the message names the file or tensor."""


class UnsupportedTensorTypeError(ModelLoadError):
    """A GGUF tensor stored in a quantization type this loader does not dequantize."""
