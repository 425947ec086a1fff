from crescent.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "token_ids", "cache_salt", "sampling", "decode_address", "prefix_source_id", "prefix_source_blocks", "prefix_source_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    sampling: _common_pb2.SamplingParams
    decode_address: str
    prefix_source_id: str
    prefix_source_blocks: int
    prefix_source_address: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., prefix_source_id: _Optional[str] = ..., prefix_source_blocks: _Optional[int] = ..., prefix_source_address: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "prompt_tokens", "cached_tokens", "finished", "finish_reason", "index", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    prompt_tokens: int
    cached_tokens: int
    finished: bool
    finish_reason: str
    index: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., index: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class HandedOff(_message.Message):
    __slots__ = ("decode_address",)
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    def __init__(self, decode_address: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "handed_off")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    handed_off: HandedOff
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., handed_off: _Optional[_Union[HandedOff, _Mapping]] = ...) -> None: ...

class FetchPrefixRequest(_message.Message):
    __slots__ = ("model_id", "block_keys", "token_ids")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_id: _Optional[str] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
