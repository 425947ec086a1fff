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
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.kv_block import KvBlock

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
        few per get: (tokens added, whether the node missed one: the rest may be on its peers)."""
        start = time.perf_counter()
        added, missed = 0, False
        for at in range(0, len(keys), DEVICE_BATCH_BLOCKS):
            batch = keys[at : at + DEVICE_BATCH_BLOCKS]
            payloads, rooms, missed = await self._get(seq, batch, lease_ms)
            try:
                added += await self.worker.run(self.engine.attach_blocks, seq, payloads) if payloads else 0
            finally:
                self.blocks.free(rooms)
            if len(payloads) < len(batch):
                break
        if added:
            m = self.metrics
            m.transfer_bytes.labels("prefill", "from_kvstore").inc(added // self.engine.block_size * self.blocks.block_bytes)
            m.transfer_seconds.labels("prefill", "from_kvstore").observe(time.perf_counter() - start)
        return added, missed

    async def _get(self, seq: Sequence, keys: Seq[BlockKey], lease_ms: int) -> tuple[list, list, bool]:
        """(the leading blocks of ``keys`` found and matching the prompt, as payloads in their rooms;
        every room; whether the node missed one)."""
        engine, block_size = self.engine, self.engine.block_size
        try:
            rooms = self.blocks.rooms(len(keys))
        except torch.OutOfMemoryError as exc:  # a cache: no room means the host way, not a failed request
            log.warning("no device memory for %d kvstore blocks (%s); fetching them the host way", len(keys), exc)
            return [], [], True
        try:
            found = await self.kvstore.get_device(keys, rooms, engine.model_id, lease_ms, stop_at_first_miss=True)
        except BaseException:
            self.blocks.free(rooms)
            raise
        first = seq.num_computed // block_size
        payloads = []
        for i, key in enumerate(keys):
            header = found.get(key)
            if header is None:
                return payloads, rooms, True
            expected = seq.token_ids[(first + i) * block_size : (first + i + 1) * block_size]
            if not block_matches(header, key, expected, engine.cache):
                log.warning("kvstore block %s does not match the prompt; recomputing from there", key.hex())
                break
            payloads.append(self.blocks.payload(rooms[i]))
        return payloads, rooms, False

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
                    rooms = await self.worker.run(self.blocks.gather, engine, seq, batch)
                except torch.OutOfMemoryError as exc:  # a cache: blocks not stored are computed again later
                    log.warning("no device memory to export %d new blocks (%s); not storing them",
                                len(indices) - at, exc)
                    indices = indices[:at]
                    break
                if at + DEVICE_BATCH_BLOCKS >= len(indices):
                    released = True
                    release()
                try:
                    result = await self.kvstore.put_device([self._header(seq, i) for i in batch], rooms)
                finally:
                    self.blocks.free(rooms)
                stored += result.stored
                nbytes += len(batch) * self.blocks.block_bytes
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

    def _header(self, seq: Sequence, index: int) -> KvBlock:
        """What the engine knows of a device block: no host bytes, no checksum (the node computes it)."""
        block_size, cache = self.engine.block_size, self.engine.cache
        return KvBlock(seq.block_keys[index], seq.block_keys[index - 1] if index else None, self.engine.model_id,
                       kv_dtype(cache), tuple(cache.block_shape),
                       tuple(seq.token_ids[index * block_size : (index + 1) * block_size]), b"", 0)
