"""Where the native engine computes and in which dtype: ``engine.device`` and ``engine.dtype``.

Both are resolved once, at start-up, before the model loads, and every error names the setting
to change. ``auto`` dtype: the checkpoint's declared ``torch_dtype`` (``dtype`` in newer
config.json files) on CUDA, float32 on the CPU (bf16 matmuls are several times slower than fp32
on CPUs without AVX-512 bf16, docs/cuda.md). A GGUF declares no dtype: its dequantized weights
are float32, and ``auto`` keeps them so.
"""

from __future__ import annotations

import re

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"
_DEVICE_RE = re.compile(DEVICE_PATTERN)


class DeviceSettingError(ValueError):
    """``engine.device`` or ``engine.dtype`` cannot be honoured on this machine; the message says which."""


def cuda_device_count() -> int:
    """CUDA devices this process sees (0 without a driver or a CUDA build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_cache_dtype_fits(kv_cache_dtype: str, model: str, kind: str, *, option: str = "") -> None:
    """The fp8 cache holds kimi_k3's MLA latents only: refuse it for another family, before the
    model loads (``option``: how the caller's user set it, e.g. " (--kv-cache-dtype)")."""
    if kv_cache_dtype == "fp8" and kind != "kimi_k3":
        raise DeviceSettingError(f"engine.kv_cache_dtype 'fp8'{option}: the fp8 cache holds kimi_k3's MLA latents "
                                 f"only; {model!r} is a {kind} model: use auto, float32, bfloat16 or float16")


def check_block_size_fits(device: str, block_size: int, kind: str, *, option: str = "") -> None:
    """A Llama-family engine on CUDA pages its cache for the Triton attention kernels, which take
    blocks of a multiple of 16 tokens: refuse another block size before the model loads (at the
    engine's start and in ``crescent up``), not at the first forward. kimi_k3 and an install
    without Triton take other paths, which take any block size."""
    if not device.startswith("cuda") or kind == "kimi_k3":  # ``device``: the setting, as written
        return
    from crescent.services.engine import attention  # torch and the kernels' module: only here

    if attention.triton_paged_attention() is None:
        return
    if (problem := attention.triton_block_size_problem(block_size)) is not None:
        raise DeviceSettingError(f"engine.block_size {block_size}{option} on engine.device {device!r}: "
                                 f"{problem}; use e.g. 64 (the default) or 16")


def resolve_device(spec: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a ``torch.device``; refuses CUDA this process cannot use."""
    if not _DEVICE_RE.match(spec):
        raise DeviceSettingError(f"engine.device {spec!r}: use 'cpu', 'cuda' or 'cuda:N'")
    device = torch.device(spec)
    if device.type == "cpu":
        return device
    count = cuda_device_count()
    if count == 0:
        built = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'not built in'})"
        raise DeviceSettingError(f"engine.device {spec!r}: no CUDA device is available to this process ({built}); "
                                 "set engine.device: cpu, or run it where a GPU is visible")
    index = 0 if device.index is None else device.index
    if index >= count:
        raise DeviceSettingError(f"engine.device {spec!r}: this process sees {count} CUDA device(s) (0..{count - 1})")
    return torch.device("cuda", index)


def checkpoint_dtype(declared: object) -> torch.dtype | None:
    """A config.json's ``torch_dtype``/``dtype`` value as a float dtype (None: not declared or not one of ours)."""
    if not isinstance(declared, str):
        return None
    return DTYPES.get(declared.removeprefix("torch."), {"float": torch.float32, "half": torch.float16}.get(declared))


def resolve_dtype(spec: str, device: torch.device, declared: torch.dtype | None) -> torch.dtype:
    """The engine's weights' and activations' dtype for ``engine.dtype`` = ``spec`` on ``device``."""
    if spec == "auto":
        return declared if device.type == "cuda" and declared is not None else torch.float32
    try:
        return DTYPES[spec]
    except KeyError:
        raise DeviceSettingError(f"engine.dtype {spec!r}: use auto, {', '.join(DTYPES)}") from None


def resolve_cache_dtype(spec: str, compute: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for ``engine.kv_cache_dtype`` = ``spec``: ``auto`` is the compute dtype."""
    if spec == "auto":
        return compute
    if spec not in DTYPES:  # fp8 is the hybrid models' latent cache; a Llama pool has no scaled format
        raise DeviceSettingError(f"engine.kv_cache_dtype {spec!r} is for hybrid models (kimi_k3) only; "
                                 f"Llama-family models take auto, {', '.join(DTYPES)}")
    return DTYPES[spec]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
