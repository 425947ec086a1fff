from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_GPU: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]
    KV_TIER_S3: _ClassVar[KvTier]
    KV_TIER_ENGINE: _ClassVar[KvTier]

class BlockEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_EVENT_UNSPECIFIED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_STORED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_REMOVED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_TIER_CHANGED: _ClassVar[BlockEventKind]
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_GPU: KvTier
KV_TIER_HOST: KvTier
KV_TIER_DISK: KvTier
KV_TIER_S3: KvTier
KV_TIER_ENGINE: KvTier
BLOCK_EVENT_UNSPECIFIED: BlockEventKind
BLOCK_EVENT_STORED: BlockEventKind
BLOCK_EVENT_REMOVED: BlockEventKind
BLOCK_EVENT_TIER_CHANGED: BlockEventKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "first_step", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "top_logprobs", "constraint", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    first_step: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    n: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., first_step: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class BlockMeta(_message.Message):
    __slots__ = ("key", "parent_key", "model_id", "format_version", "dtype", "shape", "token_ids", "nbytes", "checksum", "found")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    model_id: str
    format_version: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    found: bool
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., model_id: _Optional[str] = ..., format_version: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("meta", "data", "last")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    meta: BlockMeta
    data: bytes
    last: bool
    def __init__(self, meta: _Optional[_Union[BlockMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("kind", "key", "parent_key", "tier", "num_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEventKind
    key: bytes
    parent_key: bytes
    tier: KvTier
    num_tokens: int
    def __init__(self, kind: _Optional[_Union[BlockEventKind, str]] = ..., key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., tier: _Optional[_Union[KvTier, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class BlockEventBatch(_message.Message):
    __slots__ = ("source_id", "events", "full_snapshot")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FULL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    full_snapshot: bool
    def __init__(self, source_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., full_snapshot: _Optional[bool] = ...) -> None: ...
