"""Simulated instances: a block cache, a prefill node, a decode node (continuous batching)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from crescent.services.contract.block_keys import BlockKey
from crescent.services.scheduler.registry import LoadReport


class BlockCache:
    """An instance's prefix cache: LRU over blocks, ``capacity_blocks`` None for unbounded."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockKey, None] = OrderedDict()

    def prefix(self, keys: Sequence[BlockKey], touch: bool = True) -> int:
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            if touch:
                self._blocks.move_to_end(key)
            n += 1
        return n

    def insert(self, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[BlockKey]]:
        """Add ``keys`` (most recent last); returns (newly stored, evicted)."""
        added: list[BlockKey] = []
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
                added.append(key)
        evicted: list[BlockKey] = []
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                evicted.append(self._blocks.popitem(last=False)[0])
        return added, evicted

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass(slots=True)
class SimRequest:
    """One trace request as it moves through the cluster."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    keys: tuple[BlockKey, ...]
    prefill: str = ""
    decode: str = ""
    local_blocks: int = 0
    pull_source: str = ""
    pull_blocks: int = 0
    predicted_s: float = 0.0       # colocated: predicted prefill duration (pull + compute) when placed
    expected_compute: int = 0      # prompt tokens the placement expects it to compute
    reused_blocks: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    done_tokens: int = 0           # prompt tokens computed so far, the chunk in progress included
    chunk_tokens: int = 0          # the chunk in progress
    first_token_s: float | None = None
    last_token_s: float = 0.0
    generated: int = 0
    intervals: list[float] = field(default_factory=list)
    tbt_s: float | None = None
    finish_s: float | None = None

    @property
    def kv_tokens(self) -> int:
        return self.input_length + self.output_length


class PrefillNode:
    def __init__(self, node_id: str, cache: BlockCache) -> None:
        self.node_id = node_id
        self.cache = cache
        self.queue: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self.busy_s = 0.0              # compute time actually spent
        self.finished: list[str] = []  # request ids done since the last report

    def report(self) -> LoadReport:
        """The heartbeat a live prefill instance sends: its queue, in tokens still to compute."""
        tokens = sum(r.expected_compute for r in self.queue)
        active = [str(r.index) for r in self.queue]
        running = 0
        if self.current is not None:
            tokens += self.current.computed_tokens - self.current.done_tokens + self.current.chunk_tokens
            active.append(str(self.current.index))
            running = 1
        finished, self.finished = tuple(self.finished), []
        return LoadReport(queued_requests=len(self.queue), queued_tokens=tokens, running_requests=running,
                          active_request_ids=tuple(active), finished_request_ids=finished)


class DecodeNode:
    def __init__(self, node_id: str, max_batch: int, kv_capacity_tokens: int) -> None:
        self.node_id = node_id
        self.max_batch = max_batch
        self.kv_capacity_tokens = kv_capacity_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.kv_used = 0
        self.context = 0               # total context of the running batch
        self.incoming = 0              # colocated: placed, still in prefill
        self.incoming_kv = 0
        self.incoming_context = 0
        self.stepping = False
        self.finished: list[str] = []  # request ids done since the last report

    def report(self) -> LoadReport:
        """The heartbeat a live decode instance sends: free KV is what no request it holds was promised."""
        waiting_kv = sum(r.kv_tokens for r in self.waiting)
        active = tuple(str(r.index) for r in self.running) + tuple(str(r.index) for r in self.waiting)
        finished, self.finished = tuple(self.finished), []
        return LoadReport(
            queued_requests=len(self.waiting), queued_tokens=self.context + sum(r.input_length for r in self.waiting),
            running_requests=len(self.running), free_kv_tokens=self.kv_capacity_tokens - self.kv_used - waiting_kv,
            active_request_ids=active, finished_request_ids=finished,
        )

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            if self.kv_used + head.kv_tokens > self.kv_capacity_tokens and self.running:
                break
            self.waiting.popleft()
            self.running.append(head)
            self.kv_used += head.kv_tokens
            self.context += head.input_length + head.generated

    def view_batch(self) -> int:
        return len(self.running) + len(self.waiting) + self.incoming

    def view_context(self) -> int:
        return self.context + sum(r.input_length for r in self.waiting) + self.incoming_context

    def view_free_kv(self) -> int:
        waiting_kv = sum(r.kv_tokens for r in self.waiting)
        return self.kv_capacity_tokens - self.kv_used - waiting_kv - self.incoming_kv
