from crescent.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_ROLE_UNSPECIFIED: _ClassVar[InstanceRole]
    INSTANCE_ROLE_PREFILL: _ClassVar[InstanceRole]
    INSTANCE_ROLE_DECODE: _ClassVar[InstanceRole]
    INSTANCE_ROLE_KVSTORE: _ClassVar[InstanceRole]
    INSTANCE_ROLE_AGGREGATED: _ClassVar[InstanceRole]
INSTANCE_ROLE_UNSPECIFIED: InstanceRole
INSTANCE_ROLE_PREFILL: InstanceRole
INSTANCE_ROLE_DECODE: InstanceRole
INSTANCE_ROLE_KVSTORE: InstanceRole
INSTANCE_ROLE_AGGREGATED: InstanceRole

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "role", "address", "model_id", "block_size", "kv_capacity_tokens", "max_batch_size", "kv_format", "kv_dtype", "context_window")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: InstanceRole
    address: str
    model_id: str
    block_size: int
    kv_capacity_tokens: int
    max_batch_size: int
    kv_format: str
    kv_dtype: str
    context_window: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[InstanceRole, str]] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., kv_format: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., context_window: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "want_full_snapshot")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    WANT_FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    want_full_snapshot: bool
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., want_full_snapshot: _Optional[bool] = ...) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("instance_id", "queued_requests", "queued_tokens", "running_requests", "free_kv_tokens", "active_request_ids", "finished_request_ids", "draining", "prefill_queued_requests", "prefill_queued_tokens", "prefill_running_requests")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    queued_requests: int
    queued_tokens: int
    running_requests: int
    free_kv_tokens: int
    active_request_ids: _containers.RepeatedScalarFieldContainer[str]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    prefill_queued_requests: int
    prefill_queued_tokens: int
    prefill_running_requests: int
    def __init__(self, instance_id: _Optional[str] = ..., queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., free_kv_tokens: _Optional[int] = ..., active_request_ids: _Optional[_Iterable[str]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., prefill_queued_requests: _Optional[int] = ..., prefill_queued_tokens: _Optional[int] = ..., prefill_running_requests: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "block_keys", "prompt_tokens", "max_tokens", "block_size", "n", "unreachable_instance_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    max_tokens: int
    block_size: int
    n: int
    unreachable_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., n: _Optional[int] = ..., unreachable_instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class InstanceRef(_message.Message):
    __slots__ = ("instance_id", "address")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("reason", "message", "retry_after_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    retry_after_s: float
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill", "decode", "expected_cached_blocks", "rejection", "predicted_ttft_s", "predicted_tbt_s", "prefix_source_id", "prefix_source_blocks", "prefix_source_address")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TBT_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    prefill: InstanceRef
    decode: InstanceRef
    expected_cached_blocks: int
    rejection: Rejection
    predicted_ttft_s: float
    predicted_tbt_s: float
    prefix_source_id: str
    prefix_source_blocks: int
    prefix_source_address: str
    def __init__(self, prefill: _Optional[_Union[InstanceRef, _Mapping]] = ..., decode: _Optional[_Union[InstanceRef, _Mapping]] = ..., expected_cached_blocks: _Optional[int] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_tbt_s: _Optional[float] = ..., prefix_source_id: _Optional[str] = ..., prefix_source_blocks: _Optional[int] = ..., prefix_source_address: _Optional[str] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("info", "load", "last_heartbeat_age_s", "indexed_blocks")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    info: InstanceInfo
    load: InstanceLoad
    last_heartbeat_age_s: float
    indexed_blocks: int
    def __init__(self, info: _Optional[_Union[InstanceInfo, _Mapping]] = ..., load: _Optional[_Union[InstanceLoad, _Mapping]] = ..., last_heartbeat_age_s: _Optional[float] = ..., indexed_blocks: _Optional[int] = ...) -> None: ...

class ListInstancesReply(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ...) -> None: ...

class EventsReply(_message.Message):
    __slots__ = ("accepted", "want_full_snapshot")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    WANT_FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    want_full_snapshot: bool
    def __init__(self, accepted: _Optional[int] = ..., want_full_snapshot: _Optional[bool] = ...) -> None: ...

class RequestOutcome(_message.Message):
    __slots__ = ("request_id", "ttft_s", "cached_blocks", "released", "finished", "output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttft_s: float
    cached_blocks: int
    released: bool
    finished: bool
    output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., ttft_s: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., released: _Optional[bool] = ..., finished: _Optional[bool] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class OutcomeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
