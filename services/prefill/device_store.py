"""Prefill's kvstore export and prefix load through the node's GPU tier, device to device.

Where the engine's KV pool is on a GPU (``DeviceBlocks.for_cache``) and its kvstore client shares
device memory (a ``device_opener``: ``CudaIpc``), ``PrefillPipeline`` takes this path while the
node has not refused it (``KvStoreClient.device_path_open``):

- **export**: after the prompt, its new full blocks are gathered into device rooms on the engine
  thread, a few at a time (device-to-device copies; the prompt's pages go back once the last
  gather is queued) and put with ``put_device``: the node copies them from the rooms into its GPU
  tier and checksums its copy. No host bytes on the engine's side, and no layer-wise export (that
  one goes through pinned host memory into the node's host pool, the bounce this path avoids);
- **load**: the missing prefix is fetched with ``get_device`` into rooms (the node copies its
  blocks into them), each block's key, tokens, dtype and shape checked as the host path checks
  them, then placed into new pool pages by ``Engine.attach_blocks`` (device to device). A device
  get asks this node only: past its first miss the rest is asked the host way, which reaches the
  node's peers as before.

Kimi K3 (``K3Cache``) takes the same path. Its export gathers each block exactly as the host export
stores it: latents, with the state in front where the host export has one (a snapshot, or the
live state of a prompt that fills its last block), in a room of that block's size, its header
saying that shape. Its load cannot know a block's size before the get, so rooms are first the
size of a block without a state; the node leaves a room that is too small alone and returns the
block's header (``KvStoreClient.get_device``), whose shape, once checked, sizes the room the
block is got again into (``_again``: a second call for the blocks with states only). Blocks are
attached up to the last one with a state, as ``Engine.attach_blocks`` does after a host get;
the ones after it are held for a later state across batches, and given up if none comes.

A node with no GPU tier, on another GPU, or that cannot open this process's memory answers once:
``put_device``/``get_device`` move that call's blocks through host bytes themselves (the same
bytes: ``tests/prefill/test_device_kvstore.py``) and the client refuses ``cuda_ipc`` for that node,
so later prompts take the host path of ``pipeline.py`` (layer-wise export included) unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from crescent.services.contract.block_keys import BlockKey
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import block_matches, kv_dtype
from crescent.services.kvstore.client import KvStoreClient, room_holds
from crescent.services.kvwire.kv_block import KvBlock, expected_nbytes

log = logging.getLogger(__name__)

DEVICE_BATCH_BLOCKS = 8  # blocks gathered and put, or got and attached, per call: bounds the rooms held


class DeviceStore:
    """One prefill instance's device path to its kvstore node."""

    def __init__(self, engine: Engine, worker: EngineWorker, kvstore: KvStoreClient, blocks: DeviceBlocks,
                 metrics) -> None:  # noqa: ANN001 - the role's engine_metrics
        self.engine, self.worker, self.kvstore, self.blocks, self.metrics = engine, worker, kvstore, blocks, metrics

    @property
    def open(self) -> bool:
        """Whether to take this path now (the node has not refused device moves)."""
        return self.kvstore.device_path_open

    # ---- load --------------------------------------------------------------------------------

    async def attach(self, seq: Sequence, keys: Seq[BlockKey], lease_ms: int) -> tuple[int, bool]:
        """Attach the cached blocks of ``keys`` (the sequence's next ones) through device rooms, a
        few per get: (tokens added, whether the node missed one: the rest may be on its peers).
        A kimi_k3 sequence attaches up to its last block with a state (``DeviceBlocks.attachable``):
        blocks after it are held until a later one carries a state, as one host get would."""
        start = time.perf_counter()
        added, nbytes, missed = 0, 0, False
        held: list[torch.Tensor] = []  # got, not attached yet (each its own room)
        try:
            at = 0
            while at < len(keys):
                batch = keys[at : at + DEVICE_BATCH_BLOCKS]
                payloads, missed = await self._get(seq, batch, len(held), lease_ms)
                held.extend(payloads)
                at += len(payloads)
                ready = self.blocks.attachable(held)
                if ready:
                    attach, held = held[:ready], held[ready:]
                    try:
                        added += await self.worker.run(self.engine.attach_blocks, seq, attach)
                        nbytes += sum(p.numel() * p.element_size() for p in attach)
                    finally:
                        self.blocks.free(attach)
                if len(payloads) < len(batch):
                    break
        finally:
            self.blocks.free(held)  # no state after them: the host path would not attach them either
        if added:
            m = self.metrics
            m.transfer_bytes.labels("prefill", "from_kvstore").inc(nbytes)
            m.transfer_seconds.labels("prefill", "from_kvstore").observe(time.perf_counter() - start)
        return added, missed

    async def _get(self, seq: Sequence, keys: Seq[BlockKey], after: int, lease_ms: int) -> tuple[list, bool]:
        """(the leading blocks of ``keys`` found and matching the prompt, each a payload in a room
        of its own; whether the node missed one). ``after``: blocks got before these and not
        attached yet. A block larger than its first room (a kimi_k3 block with a state) is got
        again into a room of its size (``_again``). Rooms of blocks not returned are freed."""
        try:
            rooms = self.blocks.rooms(len(keys))
        except torch.OutOfMemoryError as exc:  # a cache: no room means the host way, not a failed request
            log.warning("no device memory for %d kvstore blocks (%s); fetching them the host way", len(keys), exc)
            return [], True
        held: set[int] = set()  # rooms whose payloads are returned
        try:
            found = await self.kvstore.get_device(keys, rooms, self.engine.model_id, lease_ms, stop_at_first_miss=True)
            headers, missed = self._matching(seq, keys, found, after)
            payloads: list[torch.Tensor | None] = []
            for i, header in enumerate(headers):
                if room_holds(header, rooms[i]):
                    payloads.append(self.blocks.payload(rooms[i], header.shape))
                    held.add(i)
                else:
                    payloads.append(None)
        finally:
            self.blocks.free([room for i, room in enumerate(rooms) if i not in held])
        if all(p is not None for p in payloads):
            return payloads, missed
        kept, gone = await self._again(headers, payloads, lease_ms)
        return kept, missed or gone

    def _matching(self, seq: Sequence, keys: Seq[BlockKey], found: dict[BlockKey, KvBlock],
                  after: int) -> tuple[list[KvBlock], bool]:
        """The headers of the leading found blocks that are the prompt's (key, tokens, dtype, a
        full block's shape, as the host path checks them); whether the node missed one."""
        block_size = self.engine.block_size
        first = seq.num_computed // block_size + after
        headers = []
        for i, key in enumerate(keys):
            header = found.get(key)
            if header is None:
                return headers, True
            expected = seq.token_ids[(first + i) * block_size : (first + i + 1) * block_size]
            if not block_matches(header, key, expected, self.engine.cache):
                log.warning("kvstore block %s does not match the prompt; recomputing from there", key.hex())
                break
            headers.append(header)
        return headers, False

    async def _again(self, headers: list[KvBlock], payloads: list, lease_ms: int) -> tuple[list, bool]:
        """Get the blocks whose payloads are None (larger than their first room) again, each into a
        room of the size its checked shape gives; (the leading payloads now complete, whether one
        went missing meanwhile). Every room not returned is freed, ``payloads``' included."""
        again = [i for i, p in enumerate(payloads) if p is None]
        before, rooms = list(payloads), []
        try:
            for i in again:
                rooms += self.blocks.rooms(1, expected_nbytes(headers[i].dtype, tuple(headers[i].shape)))
            got = await self.kvstore.get_device([headers[i].key for i in again], rooms, self.engine.model_id,
                                                lease_ms)
        except torch.OutOfMemoryError as exc:  # the blocks before this one are kept; the rest the host way
            log.warning("no device memory for a kvstore block with a state (%s); fetching it the host way", exc)
            got = {}
        except BaseException:
            self.blocks.free([*rooms, *(p for p in before if p is not None)])
            raise
        for i, room in zip(again, rooms):
            header = got.get(headers[i].key)
            if header is not None and tuple(header.shape) == tuple(headers[i].shape) and room_holds(header, room):
                payloads[i] = self.blocks.payload(room, header.shape)
        complete = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        kept = payloads[:complete]
        keep = {p.data_ptr() for p in kept}
        self.blocks.free([r for r in [*before, *rooms] if r is not None and r.data_ptr() not in keep])
        return kept, len(kept) < len(payloads)

    # ---- export ------------------------------------------------------------------------------

    async def store(self, seq: Sequence, already_cached: int, release: Callable[[], None], computed_at: float) -> None:
        """Put the prompt's new full blocks (after ``already_cached`` tokens) from device rooms;
        ``release`` lets the prompt's pages go once the last gather is queued (always called)."""
        engine, block_size = self.engine, self.engine.block_size
        indices = list(range(already_cached // block_size, len(seq.block_keys))) if seq.keeps_blocks else []
        released = False
        stored = nbytes = 0
        start = time.perf_counter()
        try:
            for at in range(0, len(indices), DEVICE_BATCH_BLOCKS):
                batch = indices[at : at + DEVICE_BATCH_BLOCKS]
                try:
                    gathered = await self.worker.run(self.blocks.gather, engine, seq, batch)
                except torch.OutOfMemoryError as exc:  # a cache: blocks not stored are computed again later
                    log.warning("no device memory to export %d new blocks (%s); not storing them",
                                len(indices) - at, exc)
                    indices = indices[:at]
                    break
                if at + DEVICE_BATCH_BLOCKS >= len(indices):
                    released = True
                    release()
                try:
                    result = await self.kvstore.put_device([self._header(seq, i, p.shape) for i, p in zip(batch, gathered)],
                                                           gathered)
                finally:
                    self.blocks.free(gathered)
                stored += result.stored
                nbytes += sum(p.numel() * p.element_size() for p in gathered)
        finally:
            if not released:
                release()
        if not indices:
            return
        if stored < len(indices):
            log.warning("kvstore kept %d of %d new blocks", stored, len(indices))
        m = self.metrics
        m.transfer_bytes.labels("prefill", "to_kvstore").inc(nbytes)
        m.transfer_seconds.labels("prefill", "to_kvstore").observe(time.perf_counter() - start)
        m.transfer_seconds.labels("prefill", "to_kvstore_exposed").observe(time.perf_counter() - computed_at)

    def _header(self, seq: Sequence, index: int, shape: Seq[int]) -> KvBlock:
        """What the engine knows of a device block: no host bytes, no checksum (the node computes
        it); ``shape``: its payload's (a kimi_k3 block's depends on whether it carries a state)."""
        block_size, cache = self.engine.block_size, self.engine.cache
        return KvBlock(seq.block_keys[index], seq.block_keys[index - 1] if index else None, self.engine.model_id,
                       kv_dtype(cache), tuple(shape),
                       tuple(seq.token_ids[index * block_size : (index + 1) * block_size]), b"", 0)
