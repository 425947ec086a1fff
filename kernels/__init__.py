"""Triton kernels for K3-class hybrid models, each beside an fp32 PyTorch reference.

Subpackages: ``kda`` (Kimi Delta Attention), ``mla`` (gated MLA over a paged latent cache),
``moe`` (routing, quantile balancing, grouped expert matmul), ``mxfp4`` (OCP MXFP4 weights),
``attnres`` (Block Attention Residuals); for the dense engine on CUDA, ``paged`` (attention over
the paged KV pool) and ``batch_invariant`` (linear, RMSNorm). ``cpu`` holds the dense engine's
production CPU ops; every ``reference.py`` is a test oracle. See kernels/README.md.
"""
