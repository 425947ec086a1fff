"""Plain PyTorch ops the engine runs today; Triton kernels replace them op by op."""

from crescent.kernels.reference.ops import (
    InvariantLinear,
    apply_rope,
    batch_invariant_linear,
    paged_attention,
    rms_norm,
    rope_tables,
    silu_and_mul,
)

__all__ = ["InvariantLinear", "apply_rope", "batch_invariant_linear", "paged_attention", "rms_norm", "rope_tables", "silu_and_mul"]
