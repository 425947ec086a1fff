"""The tiered block store of one node: placement across tiers, eviction with demotion,
promotion on lower-tier hits, leases, integrity checks, and "where is this block" events.

Tiers are ordered fastest first. A put lands in the fastest tier with room (write-through also
copies it to every lower tier); eviction past a tier's high watermark frees it down to its low
watermark, demoting each victim one tier down unless a lower tier already has it; a hit in a
lower tier copies the block back up. Leased blocks are never evicted from any tier. Every read
from disk and S3 is verified (host memory is not re-checked on every read: every client
verifies what it receives and reports a bad block back, see ``recheck``); a bad copy is
deleted, counted per tier, announced as gone, and the next tier is tried. A host-memory block
is verified before it is demoted, so corruption never spreads down.

A block can also be written in place: ``reserve`` room in the first tier's host pool, fill it,
``commit`` (the gRPC put stream and same-host clients do, saving a copy).

Runs on one asyncio loop; no locks, and every await leaves the index consistent.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockFormatError, BlockIntegrityError, KvBlock
from crescent.services.common.metrics import KvStoreMetrics
from crescent.services.kvstore.eviction import EvictionPolicy, make_eviction_policy
from crescent.services.kvstore.tier import BlockInfo, HostTier, SpaceReservation, StorageTier

log = logging.getLogger(__name__)

EventSink = Callable[[common_pb2.BlockEvent], None]


@dataclass(frozen=True, slots=True)
class TierUsage:
    kind: int
    label: str
    blocks: int
    bytes: int
    capacity_bytes: int
    evictions: int
    reserved_bytes: int = 0


class LeaseTable:
    """Key -> expiry on the monotonic clock. A leased key is pinned in every tier."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._expiry: dict[BlockKey, float] = {}
        self._clock = clock

    def grant(self, key: BlockKey, lease_ms: int) -> None:
        if lease_ms <= 0:
            return
        until = self._clock() + lease_ms / 1000
        self._expiry[key] = max(until, self._expiry.get(key, 0.0))
        if len(self._expiry) > 4096:
            self.prune()

    def release(self, key: BlockKey) -> None:
        self._expiry.pop(key, None)

    def __contains__(self, key: object) -> bool:
        until = self._expiry.get(key)  # type: ignore[arg-type]
        return until is not None and until > self._clock()

    def __len__(self) -> int:
        """Leases on record, expired ones included until the next prune."""
        return len(self._expiry)

    def prune(self) -> int:
        now = self._clock()
        for key in [k for k, until in self._expiry.items() if until <= now]:
            del self._expiry[key]
        return len(self._expiry)


class TieredStore:
    def __init__(
        self,
        tiers: list[StorageTier],
        metrics: KvStoreMetrics,
        *,
        eviction_policy: str = "lru",
        write_through: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.metrics = metrics
        self.write_through = write_through
        self.policies: list[EvictionPolicy] = [make_eviction_policy(eviction_policy) for _ in tiers]
        self.leases = LeaseTable(clock)
        self._clock = clock
        self._evictions = [0 for _ in tiers]
        self._pins: collections.Counter[BlockKey] = collections.Counter()
        self._sinks: list[EventSink] = []
        self._hits = [metrics.hits.labels(t.label) for t in tiers]  # labels() costs a few µs a call
        for tier in tiers:
            self._watch(tier)
        for i in range(len(tiers)):
            self.adopt(i)

    def adopt(self, index: int, *, announce: bool = False) -> None:
        """Track blocks a tier found by itself (a disk or S3 tier re-indexed after a restart);
        ``announce`` sends STORED events for those no faster tier holds."""
        tier, policy = self.tiers[index], self.policies[index]
        if unreadable := tier.take_unreadable():  # found while re-indexing, already deleted
            self.metrics.checksum_failures.labels(tier.label).inc(unreadable)
        for key, info in tier.items():
            if key not in policy:
                policy.insert(key)
                if announce and self.location(key) == index:
                    for sink in self._sinks:
                        sink(self._event(common_pb2.BLOCK_EVENT_STORED, key, index, info))

    # -- events ---------------------------------------------------------------------------

    def subscribe(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def location(self, key: BlockKey) -> int | None:
        """Index of the fastest tier holding ``key``."""
        for i, tier in enumerate(self.tiers):
            if key in tier:
                return i
        return None

    def _event(self, kind: int, key: BlockKey, tier_index: int | None, info: BlockInfo | None) -> common_pb2.BlockEvent:
        return common_pb2.BlockEvent(
            kind=kind,
            key=key,
            parent_key=(info.parent_key or b"") if info else b"",
            tier=self.tiers[tier_index].kind if tier_index is not None else common_pb2.KV_TIER_UNSPECIFIED,
            num_tokens=info.num_tokens if info else 0,
        )

    def _announce(self, key: BlockKey, before: int | None, info: BlockInfo | None) -> None:
        if not self._sinks:
            return
        after = self.location(key)
        if after == before:
            return
        if before is None:
            kind = common_pb2.BLOCK_EVENT_STORED
        elif after is None:
            kind = common_pb2.BLOCK_EVENT_REMOVED
        else:
            kind = common_pb2.BLOCK_EVENT_TIER_CHANGED
        event = self._event(kind, key, after, info)
        for sink in self._sinks:
            sink(event)

    def snapshot_events(self) -> list[common_pb2.BlockEvent]:
        """One STORED event per block held, at its fastest tier: a full view for the scheduler."""
        events, seen = [], set()
        for i, tier in enumerate(self.tiers):
            for key, info in tier.items():
                if key not in seen:
                    seen.add(key)
                    events.append(self._event(common_pb2.BLOCK_EVENT_STORED, key, i, info))
        return events

    # -- bookkeeping ----------------------------------------------------------------------

    def _watch(self, tier: StorageTier) -> None:
        """Tier gauges read when scraped, so the put and get paths pay nothing for them."""
        m, label = self.metrics, tier.label
        m.blocks.labels(label).set_function(lambda: len(tier))
        m.bytes.labels(label).set_function(lambda: tier.used_bytes)
        m.capacity_bytes.labels(label).set_function(lambda: tier.capacity_bytes)

    def pinned(self, key: BlockKey) -> bool:
        return self._pins[key] > 0 or key in self.leases

    def pin(self, key: BlockKey) -> None:
        """Keep ``key`` from eviction while a reader uses a view of it (pair with ``unpin``)."""
        self._pins[key] += 1

    def unpin(self, key: BlockKey) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    def usage(self) -> list[TierUsage]:
        return [
            TierUsage(t.kind, t.label, len(t), t.used_bytes, t.capacity_bytes, self._evictions[i], t.reserved_bytes)
            for i, t in enumerate(self.tiers)
        ]

    def leased_count(self) -> int:
        count = self.leases.prune()
        self.metrics.leased_blocks.set(count)
        return count

    def blocks(self) -> Iterator[tuple[BlockKey, int, BlockInfo]]:
        """Every block once, at its fastest tier: (key, tier index, info)."""
        seen: set[BlockKey] = set()
        for i, tier in enumerate(self.tiers):
            for key, info in tier.items():
                if key not in seen:
                    seen.add(key)
                    yield key, i, info

    # -- placement and eviction -----------------------------------------------------------

    async def _make_room(self, index: int, nbytes: int) -> bool:
        tier, policy = self.tiers[index], self.policies[index]
        capacity = tier.effective_capacity()
        if nbytes > capacity:
            return False
        if tier.fits(nbytes) and tier.used_bytes + tier.reserved_bytes + nbytes <= tier.high_watermark * capacity:
            return True
        target = min(tier.low_watermark * capacity, capacity - nbytes) - tier.reserved_bytes
        while tier.used_bytes > target or not tier.fits(nbytes):
            victim = policy.pop_victim(self.pinned)
            if victim is None:
                break  # the rest is leased or being read
            await self._evict(index, victim)
        return tier.fits(nbytes)

    async def _evict(self, index: int, key: BlockKey) -> None:
        tier = self.tiers[index]
        before, info = self.location(key), tier.info(key)
        lower_has_it = any(key in t for t in self.tiers[index + 1 :])
        if index + 1 < len(self.tiers) and not lower_has_it:
            try:
                block = await tier.read(key)
                if block is not None:
                    block.verify(None)  # a slower tier must never receive a bad copy
            except (BlockFormatError, BlockIntegrityError) as exc:
                log.warning("corrupt copy in tier %s, not demoting it: %s", tier.label, exc)
                self.metrics.checksum_failures.labels(tier.label).inc()
                block = None
            # Demote before deleting: the copy may be a view of memory the delete frees.
            if block is not None and await self._place(block, index + 1, copy_down=False) is not None:
                self.metrics.demotions.labels(tier.label).inc()
        await tier.delete(key)
        self._evictions[index] += 1
        self.metrics.evictions.labels(tier.label).inc()
        self._announce(key, before, info)

    async def _place(self, block: KvBlock, start: int, *, copy_down: bool, stop: int | None = None) -> int | None:
        """Write ``block`` into the first tier from ``start`` (before ``stop``) that takes it;
        with ``copy_down`` also into every tier below that one. Returns the tier index."""
        placed = None
        for i in range(start, len(self.tiers) if stop is None else stop):
            tier = self.tiers[i]
            if block.key in tier:
                self.policies[i].touch(block.key)
                placed = i
                break
            if await self._make_room(i, block.nbytes) and await tier.write(block):
                self.policies[i].insert(block.key)
                placed = i
                break
        if placed is not None and copy_down:
            await self._copy_down(block, placed)
        return placed

    async def _copy_down(self, block: KvBlock, placed: int) -> None:
        """Write-through: ``block`` also into every tier below ``placed`` that has room."""
        self.pin(block.key)  # the host copy must outlive the slower writes below
        try:
            for j in range(placed + 1, len(self.tiers)):
                tier = self.tiers[j]
                if block.key not in tier and await self._make_room(j, block.nbytes) and await tier.write(block):
                    self.policies[j].insert(block.key)
        finally:
            self.unpin(block.key)

    # -- the API --------------------------------------------------------------------------

    async def put(self, block: KvBlock) -> bool:
        """Store a block; False when it is corrupt or no tier has room for it."""
        try:
            block.verify(None)
        except BlockIntegrityError as exc:
            log.warning("rejecting put: %s", exc)
            self.metrics.checksum_failures.labels("put").inc()
            return False
        before = self.location(block.key)
        placed = await self._place(block, 0, copy_down=self.write_through)
        self._announce(block.key, before, BlockInfo.of(block))
        if placed is None:
            log.info("no tier has room for block %s (%d bytes)", block.key.hex(), block.nbytes)
        return placed is not None

    async def _read_verified(self, index: int, key: BlockKey, *, verify: bool) -> KvBlock | None:
        """Tier ``index``'s copy of ``key``, checked when ``verify``; raises on a bad copy."""
        tier = self.tiers[index]
        block = await tier.read(key)
        if block is None:
            return None
        if verify:
            block.verify(None)
        if block.key != key:
            raise BlockIntegrityError(f"tier {tier.label} returned block {block.key.hex()} for {key.hex()}")
        return block

    async def _drop_corrupt(self, index: int, key: BlockKey, exc: Exception) -> None:
        """A bad copy: count it for its tier, delete it there, and tell subscribers (a REMOVED
        event when no other tier holds the block, so the scheduler's index forgets it)."""
        tier = self.tiers[index]
        log.warning("corrupt copy in tier %s, deleting it: %s", tier.label, exc)
        self.metrics.checksum_failures.labels(tier.label).inc()
        before, info = self.location(key), tier.info(key)
        await tier.delete(key)
        self.policies[index].discard(key)
        self._announce(key, before, info)

    async def get(
        self, key: BlockKey, model_id: str | None = None, lease_ms: int = 0, *, verify: bool = False
    ) -> KvBlock | None:
        """The block from the fastest tier with a valid copy, promoted to faster tiers; None on
        a miss. ``lease_ms`` pins it against eviction for that long; ``verify`` checks copies
        from host memory too (for a block leaving the node with no reader to check it)."""
        for i, tier in enumerate(self.tiers):
            if key not in tier:
                continue
            try:
                block = await self._read_verified(i, key, verify=verify or tier.verify_reads)
                if block is None:
                    continue
            except (BlockFormatError, BlockIntegrityError) as exc:
                await self._drop_corrupt(i, key, exc)
                continue
            if model_id and block.model_id != model_id:
                log.warning("block %s belongs to model %r, not %r", key.hex(), block.model_id, model_id)
                break
            self.note_hit(i, key, lease_ms)
            if i > 0:
                await self._promote(block, i)
            return block
        self.metrics.misses.inc()
        return None

    async def reserve(self, nbytes: int, *, spare_only: bool = False) -> SpaceReservation | None:
        """Room for a block of ``nbytes`` to be written in place into the host pool, evicting to
        make it; None when the first tier is not host memory (a GPU tier comes first) or no room
        can be made. ``spare_only``: never evict, and stay below the low watermark (room held
        on speculation must not cost anything a real put would need)."""
        tier = self.tiers[0]
        if not isinstance(tier, HostTier):
            return None
        if spare_only:
            after = tier.used_bytes + tier.reserved_bytes + nbytes
            if after > tier.low_watermark * tier.capacity_bytes or not tier.fits(nbytes):
                return None
        elif not await self._make_room(0, nbytes):
            return None
        return tier.reserve(nbytes)

    def _front_host(self) -> HostTier:
        """The first tier, where reserved room lives (``reserve`` checked it is host memory)."""
        tier = self.tiers[0]
        assert isinstance(tier, HostTier)
        return tier

    def release(self, reservation: SpaceReservation) -> None:
        """Give back room that will not become a block (the writer failed or went away)."""
        self._front_host().release(reservation)

    async def commit(self, block: KvBlock, reservation: SpaceReservation) -> bool:
        """Store ``block``, whose payload was written into ``reservation`` (the block's payload is
        that view, or its CRC is in ``payload_crc``); False, and the room is released, when the
        block is corrupt."""
        tier = self._front_host()
        try:
            block.verify(None)
        except BlockIntegrityError as exc:
            log.warning("rejecting put: %s", exc)
            self.metrics.checksum_failures.labels("put").inc()
            tier.release(reservation)
            return False
        before = self.location(block.key)
        if block.key in tier:  # a concurrent writer stored it first
            tier.release(reservation)
            self.touch(block.key)
            return True
        tier.adopt(block, reservation)
        self.policies[0].insert(block.key)
        if self.write_through:
            await self._copy_down(block, 0)
        self._announce(block.key, before, BlockInfo.of(block))
        return True

    # -- same-GPU moves (CUDA IPC regions; cuda_ipc.py) ------------------------------------

    def device_tier(self):  # noqa: ANN201 - a GpuTier, or None
        """The GPU tier when it is the first tier: the only one regions are copied into."""
        tier = self.tiers[0]
        return tier if tier.kind == common_pb2.KV_TIER_GPU and hasattr(tier, "write_from") else None

    async def put_from_region(self, header: KvBlock, region) -> bool:  # noqa: ANN001 - a DeviceRegion
        """Store ``header``'s block, its payload copied device to device from an engine's region
        into the GPU tier: placed like ``put``'s blocks (room made by eviction there, recency,
        write-through, index events), checksummed on the copy (``GpuTier.write_from``). False:
        no room, or the bytes do not match the header's checksum. Raises ``IpcRefused`` when the
        copy cannot be made here (no GPU tier, another GPU, IPC refused): the caller moves host
        bytes instead."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        tier = self.device_tier()
        if tier is None:
            raise IpcRefused("this node has no GPU tier in front")
        key = header.key
        if key in tier:  # held already: nothing to copy
            self.policies[0].touch(key)
            return True
        before = self.location(key)
        try:  # copied and checked first: a bad block must not cost another one its place
            copied = tier.copy_from(header, region)
        except BlockIntegrityError as exc:
            log.warning("rejecting put: %s", exc)
            self.metrics.checksum_failures.labels("put").inc()
            return False
        if copied is None or not await self._make_room(0, region.nbytes) or key in tier:
            if copied is None or key not in tier:
                log.info("the GPU tier has no room for block %s (%d bytes)", key.hex(), region.nbytes)
            return key in tier  # (a concurrent writer may have stored it meanwhile)
        tier.adopt(*copied)
        self.policies[0].insert(key)
        if self.write_through and len(self.tiers) > 1:
            block = await tier.read(key)  # the lower tiers take host bytes
            if block is not None:
                await self._copy_down(block, 0)
        self._announce(key, before, tier.info(key))
        return True

    async def get_into(self, key: BlockKey, model_id: str | None, room, lease_ms: int = 0) -> KvBlock | None:  # noqa: ANN001
        """``key``'s block with its payload written into an engine's ``room`` on the GPU: device
        to device from the GPU tier, or from a slower tier's host bytes (verified, promoted as
        ``get`` does). Its header (empty payload when it came from the GPU tier), or None on a
        miss or another model's block. A room smaller than the block is left alone and the
        header returned all the same: its shape tells the engine the size of the room to ask
        again with (a kimi_k3 block carries a state or not). Raises ``IpcRefused`` as
        ``put_from_region``."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        tier = self.device_tier()
        if tier is None:
            raise IpcRefused("this node has no GPU tier in front")
        info = tier.info(key)
        if info is not None:
            if model_id and info.model_id != model_id:
                log.warning("block %s belongs to model %r, not %r", key.hex(), info.model_id, model_id)
                self.metrics.misses.inc()
                return None
            if room.nbytes < info.nbytes:  # not copied, no hit yet: the engine asks again with a room that fits
                return tier.header(key)
            self.pin(key)  # not evicted while its bytes are copied out
            try:
                header = tier.read_into(key, room)
            finally:
                self.unpin(key)
            if header is not None:
                self.note_hit(0, key, lease_ms)
                return header
        block = await self.get(key, model_id, lease_ms)
        if block is None:
            return None
        if room.nbytes >= block.nbytes:  # (a smaller room: as above; the block is promoted meanwhile)
            tier.fill_room(room, block.payload)
        return block

    def touch(self, key: BlockKey) -> None:
        """A writer offered a block the fastest tier holds: it is recently used again."""
        self.policies[0].touch(key)

    def note_hit(self, index: int, key: BlockKey, lease_ms: int = 0) -> None:
        """The bookkeeping of a read served from tier ``index``: hit count, recency, lease."""
        self._hits[index].inc()
        self.policies[index].touch(key)
        if lease_ms > 0:
            self.leases.grant(key, lease_ms)
            self.metrics.leased_blocks.set(len(self.leases))

    async def _promote(self, block: KvBlock, found_at: int) -> None:
        before = self.location(block.key)
        if await self._place(block, 0, copy_down=False, stop=found_at) is not None:
            self.metrics.promotions.labels(self.tiers[found_at].label).inc()
            self._announce(block.key, before, BlockInfo.of(block))

    async def recheck(self, key: BlockKey) -> bool:
        """A reader found ``key`` corrupt: verify the copy reads are served from (the fastest
        tier's) and drop it if it is bad. True when a bad copy was dropped; False when the copy
        here is intact (the damage happened on the way) or the block is gone."""
        index = self.location(key)
        if index is None:
            return False
        try:
            await self._read_verified(index, key, verify=True)
        except (BlockFormatError, BlockIntegrityError) as exc:
            await self._drop_corrupt(index, key, exc)
            return True
        log.info("a reader reported block %s corrupt, but the copy in tier %s is intact",
                 key.hex(), self.tiers[index].label)
        return False

    def exists(self, key: BlockKey) -> bool:
        return self.location(key) is not None

    async def remove(self, key: BlockKey) -> bool:
        before = self.location(key)
        if before is None:
            return False
        info = self.tiers[before].info(key)
        for tier, policy in zip(self.tiers, self.policies):
            if await tier.delete(key):
                policy.discard(key)
        self.leases.release(key)
        self._announce(key, before, info)
        return True

    async def spill(self, deadline: float) -> tuple[int, int]:
        """Before the node stops: copy what only the host tier holds down to the first tier
        that outlives the process and writes fast (the SSD tier, re-indexed at the next start;
        not S3, whose uploads would not fit a shutdown's grace period), the blocks its
        policy would keep longest first, until ``deadline`` (``clock`` time). Returns (blocks,
        bytes) copied. A bad copy is not written (as in eviction)."""
        host = next((i for i, t in enumerate(self.tiers) if isinstance(t, HostTier)), None)
        below = next((i for i, t in enumerate(self.tiers) if t.spill_target and host is not None and i > host), None)
        if host is None or below is None:
            return 0, 0
        count = nbytes = 0
        spilled: list[BlockKey] = []  # pinned while spilling: a colder block must not evict them
        try:
            for key in self.policies[host].keep_order():
                if self._clock() >= deadline:
                    break
                placed = await self._spill_one(key, host, below)
                if placed is None:
                    continue
                if not placed:
                    break  # the tier below is full of what was spilled already
                self.pin(key)
                spilled.append(key)
                count, nbytes = count + 1, nbytes + self.tiers[below].info(key).nbytes
        finally:
            for key in spilled:
                self.unpin(key)
        return count, nbytes

    async def _spill_one(self, key: BlockKey, host: int, below: int) -> bool | None:
        """Copy ``key`` from the host tier into tier ``below``: whether it went; None when there
        was nothing to copy (a lower tier has it, it is gone, or its copy is bad)."""
        if any(key in t for t in self.tiers[host + 1 :]):
            return None  # a lower tier has it already (write-through, or demoted before)
        block = await self.tiers[host].read(key)
        if block is None:
            return None
        try:
            block.verify(None)
        except (BlockFormatError, BlockIntegrityError) as exc:
            log.warning("corrupt copy in tier %s, not spilling it: %s", self.tiers[host].label, exc)
            return None
        return await self._place(block, below, copy_down=False, stop=below + 1) is not None

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()
