from crescent.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutReply(_message.Message):
    __slots__ = ("stored", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "model_id", "lease_ms", "stop_at_first_miss", "local_only")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIRST_MISS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    model_id: str
    lease_ms: int
    stop_at_first_miss: bool
    local_only: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., model_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., stop_at_first_miss: _Optional[bool] = ..., local_only: _Optional[bool] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "model_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    model_id: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., model_id: _Optional[str] = ...) -> None: ...

class ExistsReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStat(_message.Message):
    __slots__ = ("tier", "blocks", "bytes", "capacity_bytes", "evictions", "reserved_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.KvTier
    blocks: int
    bytes: int
    capacity_bytes: int
    evictions: int
    reserved_bytes: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.KvTier, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("node_id", "tiers", "leased_blocks", "gpu_uuid")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStat]
    leased_blocks: int
    gpu_uuid: str
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStat, _Mapping]]] = ..., leased_blocks: _Optional[int] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("keys", "target")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    target: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., target: _Optional[str] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("replicated", "missing")
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    replicated: int
    missing: int
    def __init__(self, replicated: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("tier", "limit", "start_after")
    TIER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.KvTier
    limit: int
    start_after: bytes
    def __init__(self, tier: _Optional[_Union[_common_pb2.KvTier, str]] = ..., limit: _Optional[int] = ..., start_after: _Optional[bytes] = ...) -> None: ...

class ListedBlock(_message.Message):
    __slots__ = ("key", "parent_key", "model_id", "tier", "nbytes", "num_tokens", "leased")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    model_id: str
    tier: _common_pb2.KvTier
    nbytes: int
    num_tokens: int
    leased: bool
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., model_id: _Optional[str] = ..., tier: _Optional[_Union[_common_pb2.KvTier, str]] = ..., nbytes: _Optional[int] = ..., num_tokens: _Optional[int] = ..., leased: _Optional[bool] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("blocks", "truncated")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[ListedBlock]
    truncated: bool
    def __init__(self, blocks: _Optional[_Iterable[_Union[ListedBlock, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ShmBlock(_message.Message):
    __slots__ = ("meta", "offset", "in_pool")
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    IN_POOL_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.BlockMeta
    offset: int
    in_pool: bool
    def __init__(self, meta: _Optional[_Union[_common_pb2.BlockMeta, _Mapping]] = ..., offset: _Optional[int] = ..., in_pool: _Optional[bool] = ...) -> None: ...

class ShmPutRequest(_message.Message):
    __slots__ = ("segment", "blocks")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    blocks: _containers.RepeatedCompositeFieldContainer[ShmBlock]
    def __init__(self, segment: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[ShmBlock, _Mapping]]] = ...) -> None: ...

class ShmGetRequest(_message.Message):
    __slots__ = ("request", "segment", "capacity", "segment_only", "mover")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ONLY_FIELD_NUMBER: _ClassVar[int]
    MOVER_FIELD_NUMBER: _ClassVar[int]
    request: GetRequest
    segment: str
    capacity: int
    segment_only: bool
    mover: str
    def __init__(self, request: _Optional[_Union[GetRequest, _Mapping]] = ..., segment: _Optional[str] = ..., capacity: _Optional[int] = ..., segment_only: _Optional[bool] = ..., mover: _Optional[str] = ...) -> None: ...

class ShmGetReply(_message.Message):
    __slots__ = ("blocks", "truncated", "pool_path", "pool_identity", "side_address", "side_token")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SIDE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[ShmBlock]
    truncated: bool
    pool_path: str
    pool_identity: str
    side_address: str
    side_token: bytes
    def __init__(self, blocks: _Optional[_Iterable[_Union[ShmBlock, _Mapping]]] = ..., truncated: _Optional[bool] = ..., pool_path: _Optional[str] = ..., pool_identity: _Optional[str] = ..., side_address: _Optional[str] = ..., side_token: _Optional[bytes] = ...) -> None: ...

class ShmReserveRequest(_message.Message):
    __slots__ = ("blocks", "mover")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOVER_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockMeta]
    mover: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[_common_pb2.BlockMeta, _Mapping]]] = ..., mover: _Optional[str] = ...) -> None: ...

class ShmSlot(_message.Message):
    __slots__ = ("granted", "offset", "held")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    offset: int
    held: bool
    def __init__(self, granted: _Optional[bool] = ..., offset: _Optional[int] = ..., held: _Optional[bool] = ...) -> None: ...

class ShmReserveReply(_message.Message):
    __slots__ = ("reservation", "pool_path", "slots", "expires_ms", "pool_identity", "side_address", "side_token", "engine_metadata", "pool_base")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    POOL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SIDE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIDE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_METADATA_FIELD_NUMBER: _ClassVar[int]
    POOL_BASE_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    pool_path: str
    slots: _containers.RepeatedCompositeFieldContainer[ShmSlot]
    expires_ms: int
    pool_identity: str
    side_address: str
    side_token: bytes
    engine_metadata: bytes
    pool_base: int
    def __init__(self, reservation: _Optional[int] = ..., pool_path: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[ShmSlot, _Mapping]]] = ..., expires_ms: _Optional[int] = ..., pool_identity: _Optional[str] = ..., side_address: _Optional[str] = ..., side_token: _Optional[bytes] = ..., engine_metadata: _Optional[bytes] = ..., pool_base: _Optional[int] = ...) -> None: ...

class ShmCommitRequest(_message.Message):
    __slots__ = ("reservation", "written", "blocks", "reserve_next")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_NEXT_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    written: _containers.RepeatedScalarFieldContainer[bool]
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockMeta]
    reserve_next: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation: _Optional[int] = ..., written: _Optional[_Iterable[bool]] = ..., blocks: _Optional[_Iterable[_Union[_common_pb2.BlockMeta, _Mapping]]] = ..., reserve_next: _Optional[_Iterable[int]] = ...) -> None: ...

class ShmCommitReply(_message.Message):
    __slots__ = ("stored", "rejected", "next")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    stored: int
    rejected: int
    next: ShmReserveReply
    def __init__(self, stored: _Optional[int] = ..., rejected: _Optional[int] = ..., next: _Optional[_Union[ShmReserveReply, _Mapping]] = ...) -> None: ...

class RegionBlock(_message.Message):
    __slots__ = ("meta", "region")
    META_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.BlockMeta
    region: bytes
    def __init__(self, meta: _Optional[_Union[_common_pb2.BlockMeta, _Mapping]] = ..., region: _Optional[bytes] = ...) -> None: ...

class RegionPutRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[RegionBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[RegionBlock, _Mapping]]] = ...) -> None: ...

class RegionGetRequest(_message.Message):
    __slots__ = ("request", "rooms")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    request: GetRequest
    rooms: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request: _Optional[_Union[GetRequest, _Mapping]] = ..., rooms: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RegionGetReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[RegionBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[RegionBlock, _Mapping]]] = ...) -> None: ...
