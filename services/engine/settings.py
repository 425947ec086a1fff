"""Settings of a model engine instance (prefill or decode role)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.common.settings import StrictModel
from crescent.services.engine.device import DEVICE_PATTERN
from crescent.services.engine.kimi_k3.config import DEFAULT_SNAPSHOT_EVERY_BLOCKS, DEFAULT_SNAPSHOT_SLOTS
from crescent.services.engine.parallel.settings import ParallelSettings
from crescent.services.engine_vllm.settings import VllmSettings
from crescent.services.model.model_source import DEFAULT_MODEL


class EngineSettings(StrictModel):
    backend: Literal["native", "vllm"] = Field(
        default="native",
        description="what computes: 'native', Crescent's own engine (the CPU default and the bit-exact reference), "
                    "or 'vllm', vLLM's engine in this process with Crescent's KV connector (GPU pools; any model "
                    "vLLM serves). docs/engine-backends.md",
    )
    model: str = Field(default=DEFAULT_MODEL, description="preset name, .gguf path or Hugging Face directory")
    kv_capacity_tokens: int = Field(default=32768, ge=1, description="token slots in the paged KV cache")
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, le=4096, description="tokens per KV block/page")
    prefill_chunk_tokens: int = Field(default=2048, ge=1, description="prompt tokens per prefill forward pass")
    min_cached_prompt_tokens: int = Field(
        default=256, ge=0,
        description="a prompt of at most this many tokens leaves nothing in the prefix cache (Kimi's API "
                    "rule: a hit needs the earlier prompt to be longer than 256 tokens), so short guessable "
                    "prompts cannot be probed through cached_tokens or timing; 0: every prompt's blocks are kept",
    )
    threads: int = Field(default=2, ge=1, description="torch intra-op threads")
    device: str = Field(
        default="cpu", pattern=DEVICE_PATTERN,
        description="backend native: where weights, activations and the paged KV pool live: 'cpu', 'cuda' (the "
                    "process's first visible GPU) or 'cuda:N'; a CUDA device this process cannot see is refused at "
                    "start-up. docs/cuda.md",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="backend native: the weights' and activations' dtype; 'auto': the checkpoint's torch_dtype on "
                    "CUDA (a GGUF's dequantized weights: float32), float32 on the CPU (bf16 is several times slower "
                    "there). Logits are sampled on the host from a float32 copy. docs/cuda.md",
    )
    mxfp4_experts: Literal["packed", "dequantize"] = Field(
        default="packed",
        description="routed experts stored in MXFP4: 'packed' keeps them packed in memory (4.25 bits per weight) "
                    "and multiplies through the MXFP4 matmul; 'dequantize' expands them to fp32 at load",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = Field(
        default="auto",
        description="dtype of the paged KV cache. Llama-family models: 'auto' is engine.dtype's (K and V are "
                    "rounded to it when written). Hybrid models (kimi_k3): the dtype the cache stores MLA latents "
                    "and KDA conv-tail snapshots in (compute stays fp32; KDA states are always fp32); 'auto': the "
                    "model's (a real checkpoint's torch_dtype, bf16 for the public ones; fp32 for Crescent's "
                    "presets); 'float32' for exact fp32 serving at twice the latent bytes; 'fp8' (kimi_k3 only): "
                    "e4m3 latents with a scale, half of bf16's bytes (vLLM's kv_cache_dtype=fp8; conv tails "
                    "stay bf16)",
    )
    state_snapshot_every_blocks: int = Field(
        default=DEFAULT_SNAPSHOT_EVERY_BLOCKS, ge=0,
        description="hybrid models (kimi_k3): the prefix cache keeps a KDA state snapshot at the end of every "
                    "k-th block of a prompt (0: none of these), and always at the prompt's last full block; "
                    "a prefix hit resumes from the last snapshot at or below the match and recomputes the rest "
                    "(docs/k3.md measures the trade-off)",
    )
    state_snapshots: int = Field(
        default=DEFAULT_SNAPSHOT_SLOTS, ge=0,
        description="hybrid models (kimi_k3): KDA state snapshots the prefix cache holds at most (least recently "
                    "used evicted), allocated at start-up; each is one sequence's whole KDA state (449 MB for the "
                    "full Kimi K3: `crescent plan` sets this to what it budgets; decode resumes no prefix: 0)",
    )
    max_batch_size: int = Field(
        default=16, ge=1, description="decode: sequences per step (more are accepted: they wait for a slot)"
    )
    drain_grace_s: float = Field(
        default=100.0, ge=0,
        description="on SIGTERM: how long requests in flight may run to completion before they are ended "
                    "(decode: with UNAVAILABLE 'decode draining', which the gateway migrates); keep it below the "
                    "pod's terminationGracePeriodSeconds",
    )
    parallel: ParallelSettings = Field(
        default=ParallelSettings(),
        description="tensor parallelism: this instance computed by a group of processes (a LeaderWorkerSet's pods; "
                    "docs/operators.md, \"Multi-node engines\"); by default one process",
    )
    vllm: VllmSettings = Field(
        default=VllmSettings(), description="backend 'vllm': vLLM's engine arguments (ignored by the native backend)"
    )
