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
    __slots__ = ("keys", "model_id", "lease_ms", "stop_at_first_miss")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIRST_MISS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    model_id: str
    lease_ms: int
    stop_at_first_miss: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., model_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., stop_at_first_miss: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("tier", "blocks", "bytes", "capacity_bytes", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.KvTier
    blocks: int
    bytes: int
    capacity_bytes: int
    evictions: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.KvTier, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatReply(_message.Message):
    __slots__ = ("node_id", "tiers", "leased_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStat]
    leased_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStat, _Mapping]]] = ..., leased_blocks: _Optional[int] = ...) -> None: ...
