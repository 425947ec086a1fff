from crescent.protos import common_pb2 as _common_pb2
from crescent.protos import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffHeader(_message.Message):
    __slots__ = ("request_id", "model_id", "prompt_token_ids", "first_token_id", "sampling", "kv_dtype", "kv_block_shape", "num_blocks", "first_token_ids", "finished_choices", "num_layers", "shm_segment", "shm_identity", "tcp_token", "vllm_cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_CHOICES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHM_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TCP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VLLM_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    kv_dtype: str
    kv_block_shape: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_choices: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    shm_segment: str
    shm_identity: str
    tcp_token: bytes
    vllm_cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_dtype: _Optional[str] = ..., kv_block_shape: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., finished_choices: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., shm_segment: _Optional[str] = ..., shm_identity: _Optional[str] = ..., tcp_token: _Optional[bytes] = ..., vllm_cache_salt: _Optional[str] = ...) -> None: ...

class OpenHandoffRequest(_message.Message):
    __slots__ = ("request_id", "total_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    total_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class OpenHandoffReply(_message.Message):
    __slots__ = ("address", "token")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    token: bytes
    def __init__(self, address: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class LayerSliceMeta(_message.Message):
    __slots__ = ("layer", "first_block", "num_blocks", "last_block_tokens", "nbytes", "crc32")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_block: int
    num_blocks: int
    last_block_tokens: int
    nbytes: int
    crc32: int
    def __init__(self, layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., last_block_tokens: _Optional[int] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class LayerSlice(_message.Message):
    __slots__ = ("meta", "data", "last")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    meta: LayerSliceMeta
    data: bytes
    last: bool
    def __init__(self, meta: _Optional[_Union[LayerSliceMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class HandoffTail(_message.Message):
    __slots__ = ("first_token_id", "first_token_ids", "finished_choices")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_CHOICES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_choices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., finished_choices: _Optional[_Iterable[int]] = ...) -> None: ...

class HandoffPart(_message.Message):
    __slots__ = ("header", "block", "layer", "tail", "state")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    block: _common_pb2.BlockChunk
    layer: LayerSlice
    tail: HandoffTail
    state: _common_pb2.BlockChunk
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.BlockChunk, _Mapping]] = ..., layer: _Optional[_Union[LayerSlice, _Mapping]] = ..., tail: _Optional[_Union[HandoffTail, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.BlockChunk, _Mapping]] = ...) -> None: ...

class HandoffReply(_message.Message):
    __slots__ = ("accepted", "first_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    first_tokens: _containers.RepeatedCompositeFieldContainer[_prefill_pb2.FirstToken]
    def __init__(self, accepted: _Optional[bool] = ..., first_tokens: _Optional[_Iterable[_Union[_prefill_pb2.FirstToken, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason", "one_choice", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ONE_CHOICE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    one_choice: bool
    index: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., one_choice: _Optional[bool] = ..., index: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
