"""What the connector's scheduler side tells its workers each step (pickled by vLLM between its
processes: plain dataclasses of ints, bytes and tuples).

Block ids are per KV cache group (vLLM's hybrid allocator gives each group its own table):
``block_ids[g]`` for the ``g``-th attention group, ``state_block_ids[s]`` for the ``s``-th
recurrent-state group (hybrid_layout.py); a model without recurrent layers has one attention group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # Crescent's own venv (no vLLM): the connector's planning is unit-tested there
    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's empty base class."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks of one request to read from the kvstore into vLLM's blocks."""

    request_id: str
    keys: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]       # each block's tokens: a hit also compares them
    block_ids: tuple[tuple[int, ...], ...]       # per attention group: vLLM's blocks, one per key
    state_key: bytes = b""                       # hybrid: the snapshot after the last key's block
    state_block_ids: tuple[int, ...] = ()        # per state group: the block that snapshot lands in


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """One prompt block this step completes, to be copied out layer by layer and stored."""

    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]                   # per attention group


@dataclass(frozen=True, slots=True)
class StateSaveSpec:
    """A recurrent-state snapshot vLLM keeps at a block boundary, stored beside that block."""

    key: bytes                                   # hybrid_layout.state_key of the block's key
    token_ids: tuple[int, ...]                   # the block's tokens (checked on load, like a block's)
    block_ids: tuple[int, ...]                   # per state group


@dataclass
class CrescentConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    state_saves: list[StateSaveSpec] = field(default_factory=list)
