"""vLLM's engine in this process (``AsyncLLM``, fed token ids), started with Crescent's KV
connector, and what the instance shell needs to know of it (``BackendFacts``).

vLLM's own tokenizer is loaded only for structured outputs; the gateway owns the text. Its
prefix cache stays on: a tenant's salt reaches it as vLLM's cache salt, so two tenants never
share a block there either.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from crescent.services.engine.settings import EngineSettings
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.model_dir import VllmModel

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "crescent.services.engine_vllm.connector"


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """What an instance registers with (the scheduler checks instances of one model agree)."""

    model_id: str
    block_size: int
    kv_capacity_tokens: int
    kv_format: str
    kv_dtype: str
    max_model_len: int
    vocab_size: int


def prepare_environment(settings: EngineSettings, cache_dir: Path) -> None:
    """vLLM reads these at import: set them first (an operator's own values win)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{settings.vllm.cpu_kv_cache_gb:g}")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # CPU build: engine.threads OpenMP threads, unpinned, as crescent up shares the cores among processes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(settings.threads))


def engine_args(settings: EngineSettings, model: VllmModel, connector: ConnectorOptions | None):  # noqa: ANN201
    """vLLM's ``AsyncEngineArgs`` for these settings; unknown ``engine_args`` names are an error."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    v = settings.vllm
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(v.engine_args) - known)
    if unknown:
        raise ValueError(f"engine.vllm.engine_args: unknown vLLM engine argument(s) {', '.join(unknown)}")
    args = dict(
        model=str(model.directory), served_model_name=[model.model_id], dtype=v.dtype,
        max_model_len=v.max_model_len, block_size=settings.block_size, enable_prefix_caching=True,
        tensor_parallel_size=v.tensor_parallel_size, pipeline_parallel_size=v.pipeline_parallel_size,
        data_parallel_size=v.data_parallel_size, enable_expert_parallel=v.enable_expert_parallel,
        quantization=v.quantization, kv_cache_dtype=v.kv_cache_dtype,
        gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
        trust_remote_code=v.trust_remote_code, disable_log_stats=True,
        structured_outputs_config={"backend": "guidance"},
    )
    if v.max_num_seqs is not None:
        args["max_num_seqs"] = v.max_num_seqs
    if v.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = v.max_num_batched_tokens
    if connector is not None:
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CrescentConnector", kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=connector.to_extra_config())
    args.update(v.engine_args)
    return AsyncEngineArgs(**args)


def start_engine(settings: EngineSettings, model: VllmModel, connector: ConnectorOptions | None):  # noqa: ANN201
    """Start vLLM (minutes on a CPU: it loads, profiles and compiles); returns (AsyncLLM, facts)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    config = engine_args(settings, model, connector).create_engine_config()
    llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    return llm, facts_of(llm.vllm_config, model.model_id)


def facts_of(config, model_id: str) -> BackendFacts:  # noqa: ANN001 - vllm.config.VllmConfig
    from crescent.services.engine_vllm.kv_layout import NATIVE_LAYOUTS, attention_layout

    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    layout = attention_layout(config)
    layers, heads, dim = model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size()
    if model.is_hybrid:  # attention blocks beside recurrent-state snapshots (hybrid_layout.py): vLLM's alone
        kv_format = f"vllm-hybrid-{layout}:" + "x".join(map(str, (heads, cache.block_size, dim)))
    elif layout in NATIVE_LAYOUTS:  # blocks are the native engine's (kv_layout.py)
        kv_format = "paged-v1:" + "x".join(map(str, (layers, 2, cache.block_size, heads, dim)))
    else:  # vLLM's own rows, named by layout: shared only with vLLM instances that hold the same
        kv_format = f"vllm-{layout}:" + "x".join(map(str, (layers, heads, cache.block_size, dim)))
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    blocks = cache.num_gpu_blocks or 0
    return BackendFacts(model_id=model_id, block_size=cache.block_size, kv_capacity_tokens=blocks * cache.block_size,
                        kv_format=kv_format, kv_dtype=str(dtype).removeprefix("torch."),
                        max_model_len=model.max_model_len, vocab_size=model.get_vocab_size())
