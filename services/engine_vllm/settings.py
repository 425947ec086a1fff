"""Settings of the vLLM engine backend (``engine.backend: vllm``; ``engine.vllm`` in a role's
settings). Importable without vLLM: the launcher, the chart's config checks and ``crescent plan``
read them in environments where vLLM is not installed.

Each field maps onto one of vLLM's engine arguments (``AsyncEngineArgs``); ``engine_args`` takes
any other argument by its vLLM name and is checked against vLLM's own list at start.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from crescent.services.common.settings import StrictModel


class VllmSettings(StrictModel):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="weights' and activations' dtype ('auto': the checkpoint's; float32 on vLLM's CPU build "
                    "for bit-comparable CPU runs)",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="context window in tokens (None: the checkpoint's own)"
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards each layer over")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="stages the layers are split into")
    data_parallel_size: int = Field(
        default=1, ge=1,
        description="engine replicas inside the instance (with enable_expert_parallel: the expert-parallel width "
                    "is tensor_parallel_size x data_parallel_size)",
    )
    enable_expert_parallel: bool = Field(
        default=False, description="shard MoE experts across the tensor x data parallel GPUs instead of slicing each"
    )
    quantization: str | None = Field(
        default=None, description="vLLM quantization method ('mxfp4', 'fp8', ...); None: from the checkpoint's config"
    )
    kv_cache_dtype: str = Field(default="auto", description="vLLM's KV cache dtype ('auto', 'fp8', ...)")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="GPU builds: share of each GPU's memory vLLM may take (weights + KV)"
    )
    cpu_kv_cache_gb: float = Field(
        default=2.0, gt=0, description="CPU build only: GiB of host memory for vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)"
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="sequences per step (None: vLLM's default)")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="tokens per step, prompt chunks included (None: vLLM's default)"
    )
    enforce_eager: bool = Field(default=False, description="no CUDA graphs / torch.compile (faster start, slower steps)")
    trust_remote_code: bool = Field(default=False, description="let the checkpoint run its own Python code")
    kv_connector: bool = Field(
        default=True,
        description="plug Crescent's KV connector in: prompt prefixes found in and saved to the node's kvstore under "
                    "Crescent's block keys, and what vLLM caches reported to the scheduler's prefix index",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="any other vLLM engine argument by its name (e.g. {'speculative_config': {...}}); unknown names "
                    "stop the instance at start",
    )
