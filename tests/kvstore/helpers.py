"""Blocks for kvstore tests."""

from __future__ import annotations

import os

from crescent.services.contract.block_keys import BlockKey, prefix_block_keys
from crescent.services.kvwire.kv_block import KvBlock

MODEL = "test-model"
BLOCK_TOKENS = 4


def make_chain(n: int, floats: int = 256, salt: bytes = b"", model: str = MODEL) -> list[KvBlock]:
    """``n`` chained blocks of a random prompt, each ``4 * floats`` payload bytes."""
    tokens = list(os.urandom(n * BLOCK_TOKENS))
    keys = prefix_block_keys(tokens, BLOCK_TOKENS, model, salt)
    blocks, parent = [], None
    for i, key in enumerate(keys):
        toks = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        blocks.append(KvBlock.build(key, parent, model, "float32", (floats,), toks, os.urandom(4 * floats)))
        parent = key
    return blocks


def key_of(block: KvBlock) -> BlockKey:
    return block.key
