"""A safetensors file's header — names, dtypes, shapes, byte offsets — read without its tensors.

The format: an 8-byte little-endian header length, then that many bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__``).
Reading it costs one small read per shard, so the loader and ``crescent plan`` can learn what a
checkpoint stores (its weights' dtype, its bytes) before, or instead of, loading anything.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from crescent.services.engine.loader.errors import ModelLoadError

FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str               # safetensors' name: "BF16", "F32", "U8", ...
    shape: tuple[int, ...]
    nbytes: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor of one shard, from its header alone."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ModelLoadError(f"{file}: safetensors header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {file}: {exc}") from exc
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        out[name] = TensorEntry(entry["dtype"], tuple(entry["shape"]), end - start)
    return out


def stored_float_dtype(files: Iterable[Path]) -> str | None:
    """The torch dtype name most of the shards' floating-point bytes are stored in (bf16 for the
    public Kimi checkpoints, their MXFP4 experts aside), or None without float tensors."""
    bytes_by_dtype: Counter[str] = Counter()
    for file in files:
        for entry in read_header(file).values():
            if entry.dtype in FLOAT_DTYPES:
                bytes_by_dtype[FLOAT_DTYPES[entry.dtype]] += entry.nbytes
    return bytes_by_dtype.most_common(1)[0][0] if bytes_by_dtype else None


def stored_bytes(files: Iterable[Path]) -> int:
    """The bytes of every tensor the shards hold (what loading them must at least read)."""
    return sum(e.nbytes for file in files for e in read_header(file).values())
