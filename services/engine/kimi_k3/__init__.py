"""The kimi_k3 model family: Kimi K3-class hybrid models (KDA + gated MLA, latent MoE, Block
AttnRes) with state-aware prefix caching. See docs/k3.md."""

from typing import TYPE_CHECKING, Any

from crescent.services.engine.kimi_k3.config import K3_FULL, NANO, K3Config
from crescent.services.engine.kimi_k3.memory import CacheFootprint, dense_gqa_kv_bytes_per_token, k3_footprint

if TYPE_CHECKING:
    from crescent.services.engine.kimi_k3.model import K3Model
    from crescent.services.engine.kimi_k3.ops import K3Ops, OpsBackend, select_backend, situ_glu

# The compute parts import torch: loaded on first use, so what only plans (the `crescent` CLI, the
# gateway and scheduler processes it starts) never loads torch for a config.
_LAZY = {"K3Model": "model", "OpsBackend": "ops", "K3Ops": "ops", "select_backend": "ops", "situ_glu": "ops"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)

__all__ = [
    "K3_FULL", "NANO", "K3Config", "K3Model", "CacheFootprint", "k3_footprint", "dense_gqa_kv_bytes_per_token",
    "OpsBackend", "K3Ops", "select_backend", "situ_glu",
]
