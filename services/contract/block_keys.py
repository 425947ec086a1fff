"""Block keys: chained hashes that name a prefix of KV blocks.

A block is ``block_size`` consecutive prompt tokens. Its key is
``hash(parent_key, token_ids, model_id, salt)``, so equal keys mean equal prefixes, and a key
names its whole prefix, not just its own tokens. The salt isolates tenants: without it, whether a
prefix is cached leaks through timing. Only full blocks get keys; a partial last block is always
recomputed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockKey = NewType("BlockKey", bytes)

KEY_BYTES = 16  # 128-bit BLAKE2b: collisions are negligible, and a hit still compares tokens

# 64 tokens per block: on this model one block's KV is ~2.9 MB in fp32, big enough that
# per-block overhead (gRPC message, index entry, checksum call) stays small next to the bytes,
# small enough that a prefix hit wastes at most 63 tokens of recompute.
DEFAULT_BLOCK_SIZE = 64


def block_key(parent: BlockKey | None, token_ids: Sequence[int], model_id: str, salt: bytes = b"") -> BlockKey:
    """The key of one block whose prefix is named by ``parent`` (None for the first block)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent or b"\x00" * KEY_BYTES)
    encoded_model = model_id.encode()
    h.update(struct.pack("<I", len(encoded_model)))
    h.update(encoded_model)
    h.update(struct.pack("<I", len(salt)))
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return BlockKey(h.digest())


def prefix_block_keys(
    token_ids: Sequence[int], block_size: int, model_id: str, salt: bytes = b""
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``, in order."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], model_id, salt)
        keys.append(parent)
    return keys
