"""Moved to ``crescent.services.contract.block_keys`` (issue 28); this name stays only so branches
written before the move still import. New code imports the contract."""

from crescent.services.contract.block_keys import (  # noqa: F401
    DEFAULT_BLOCK_SIZE, KEY_BYTES, BlockKey, block_key, prefix_block_keys,
)
