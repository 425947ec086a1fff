"""What the connector's scheduler side tells its workers each step (pickled by vLLM between its
processes: plain dataclasses of ints, bytes and tuples)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks of one request to read from the kvstore into vLLM's blocks before the step."""

    request_id: str
    keys: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens: a hit also compares them
    block_ids: tuple[int, ...]               # vLLM's blocks they land in, one per key


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """One prompt block this step completes, to be copied out layer by layer and stored."""

    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass
class CrescentConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
