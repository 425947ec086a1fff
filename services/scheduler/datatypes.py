"""Plain data the scheduling core works on: no protobuf, no network, no clock of its own.

The live service converts protobuf to these; the simulator builds them directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from crescent.services.contract.block_keys import BlockKey
from crescent.services.contract.choices import choices_kv_tokens

InstanceId = NewType("InstanceId", str)
SourceId = NewType("SourceId", str)  # an instance or a kvstore node that holds blocks


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    KVSTORE = "kvstore"  # a shared source of prefix blocks; never placed on
    AGGREGATED = "aggregated"  # prefills and decodes in one process: a candidate for either role

    def serves(self, role: Role) -> bool:
        """Whether an instance of this role takes work of ``role`` (prefill or decode)."""
        return self is role or (self is Role.AGGREGATED and role in (Role.PREFILL, Role.DECODE))


class Tier(enum.IntEnum):
    """Where a block lives; values match ``crescent.v1.KvTier``."""

    GPU = 1
    HOST = 2
    DISK = 3
    S3 = 4
    ENGINE = 5


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    """A live prefill instance as the policy sees it."""

    instance_id: InstanceId
    queue_s: float              # predicted wait before this request's prefill starts
    queued_requests: int = 0
    address: str = ""
    # How long a prompt takes here, when not the cluster's prefill model (an aggregated instance:
    # its chunks share steps with the sequences it decodes); anything with seconds(new, cached).
    prefill_cost: object | None = None


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """A live decode instance: the requests it holds or was promised, and its free KV room.

    ``max_batch_size`` is not an admission limit: decode queues what exceeds it, which the
    policy predicts as a wait for a batch slot.
    """

    instance_id: InstanceId
    batch_size: int             # requests it holds (running or waiting) or was promised
    context_tokens: int         # their total context
    free_kv_tokens: int | None  # KV not promised to anyone; None: the instance did not say (no limit)
    max_batch_size: int = 0     # 0: no limit
    address: str = ""
    kv_capacity_tokens: int | None = None  # None: not stated
    # (seconds until it frees, KV tokens) for each request it holds or was promised, soonest first.
    releases: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    request_id: str
    block_keys: tuple[BlockKey, ...]
    prompt_tokens: int
    max_tokens: int
    block_size: int
    n: int = 1  # choices decoded from the prompt, on one decode instance

    @property
    def sequences(self) -> int:
        """Rows the request adds to its decode batch: one per choice."""
        return max(self.n, 1)

    @property
    def decode_kv_tokens(self) -> int:
        """Decode KV the request holds for its life: the prompt's full blocks are shared by the
        choices, so n choices cost less than n requests."""
        return choices_kv_tokens(self.prompt_tokens, self.max_tokens, self.n, self.block_size)


@dataclass(frozen=True, slots=True)
class PrefixPull:
    """Blocks the prefill instance should load from another source (and keep: replication)."""

    source: SourceId
    blocks: int                 # leading blocks of the prompt available there
    seconds: float              # predicted transfer time


@dataclass(frozen=True, slots=True)
class Placement:
    prefill: InstanceId
    decode: InstanceId
    local_blocks: int           # leading blocks already in the prefill instance's own cache
    pull: PrefixPull | None     # set when a longer prefix is pulled from elsewhere
    predicted_ttft_s: float
    predicted_tbt_s: float

    @property
    def cached_blocks(self) -> int:
        return max(self.local_blocks, self.pull.blocks if self.pull else 0)


@dataclass(frozen=True, slots=True)
class Rejection:
    # "no_prefill_instance", "no_decode_instance", "ttft_slo", "tbt_slo", "decode_kv_full",
    # "exceeds_kv_capacity" (the request can never fit: not worth a retry)
    reason: str
    message: str
    retry_after_s: float


Decision = Placement | Rejection


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tbt_s: float
    reject_early: bool = True
    decode_wait_in_tbt: bool = False  # see SloSettings


@dataclass(slots=True)
class PrefixMatch:
    """Leading blocks of one prompt held by each source (only sources with at least one)."""

    by_source: dict[SourceId, int] = field(default_factory=dict)

    def blocks(self, source: str) -> int:
        return self.by_source.get(SourceId(source), 0)

    def best(self, exclude: str | None = None) -> tuple[SourceId | None, int]:
        best_src: SourceId | None = None
        best = 0
        for src, n in self.by_source.items():
            if src != exclude and n > best:
                best_src, best = src, n
        return best_src, best
