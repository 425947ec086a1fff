"""Triton kernels for K3-class hybrid models, each beside an fp32 PyTorch reference.

Subpackages: ``kda`` (Kimi Delta Attention), ``mla`` (gated MLA over a paged latent cache),
``moe`` (routing, quantile balancing, grouped expert matmul), ``mxfp4`` (OCP MXFP4 weights),
``attnres`` (Block Attention Residuals). See kernels/README.md.
"""
