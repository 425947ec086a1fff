"""The kimi_k3 model family: Kimi K3-class hybrid models (KDA + gated MLA, latent MoE, Block
AttnRes) with state-aware prefix caching. See docs/k3.md."""

from crescent.services.engine.kimi_k3.config import K3_FULL, NANO, K3Config
from crescent.services.engine.kimi_k3.memory import CacheFootprint, dense_gqa_kv_bytes_per_token, k3_footprint
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.ops import OpsBackend, K3Ops, select_backend, situ_glu

__all__ = [
    "K3_FULL", "NANO", "K3Config", "K3Model", "CacheFootprint", "k3_footprint", "dense_gqa_kv_bytes_per_token",
    "OpsBackend", "K3Ops", "select_backend", "situ_glu",
]
