"""Production ops of the dense (Llama-family) engine on CPU: batch-invariant linear, RMSNorm,
RoPE, SwiGLU, paged attention (PyTorch) and the compiled decode attention (``cpu_ext``).

These serve requests; they are not test oracles (those are the ``reference.py`` files beside
each Triton kernel).
"""

from crescent.kernels.cpu.ops import (
    InvariantLinear,
    apply_rope,
    batch_invariant_linear,
    paged_attention,
    rms_norm,
    rope_tables,
    silu_and_mul,
)

__all__ = ["InvariantLinear", "apply_rope", "batch_invariant_linear", "paged_attention", "rms_norm", "rope_tables", "silu_and_mul"]
