"""The local SSD tier: one file per block in a directory, re-indexed on start.

Files are written to a temporary name and renamed, so a crash leaves either the whole block or
nothing under its final name; a torn or altered file fails verification and reads as a miss.
A full disk (ENOSPC, EDQUOT) makes the tier report itself full until something is deleted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockFormatError, KvBlock
from crescent.services.kvstore import block_file
from crescent.services.kvstore.config import DiskTierSettings
from crescent.services.kvstore.tier import BlockInfo, StorageTier

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskTier(StorageTier):
    kind = common_pb2.KV_TIER_DISK
    spill_target = True  # re-indexed at the next start

    def __init__(self, settings: DiskTierSettings) -> None:
        super().__init__(settings)
        assert settings.path is not None  # the settings validator requires it
        self.root = Path(settings.path)
        self._full_at: int | None = None  # used_bytes when the disk said it was full

    def path_of(self, key: BlockKey) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def effective_capacity(self) -> int:
        if self._full_at is not None:
            return min(self.capacity_bytes, self._full_at)
        return self.capacity_bytes

    async def start(self) -> None:
        await asyncio.to_thread(self._reindex)
        log.info("disk tier %s: %d blocks, %d bytes found", self.root, len(self), self.used_bytes)

    def _reindex(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob(f"*/*{SUFFIX}*"):
            if not path.name.endswith(SUFFIX):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            try:
                with path.open("rb") as f:
                    meta = block_file.read_meta(f)
                size = path.stat().st_size
                key = BlockKey(bytes(meta.key))
                if path != self.path_of(key) or size < meta.nbytes:
                    raise BlockFormatError("file name or size does not match its header")
            except (OSError, BlockFormatError) as exc:
                log.warning("disk tier: dropping unreadable %s: %s", path, exc)
                path.unlink(missing_ok=True)
                self._unreadable += 1
                continue
            parent = BlockKey(bytes(meta.parent_key)) if meta.parent_key else None
            self._indexed(key, BlockInfo(meta.nbytes, parent, meta.model_id, len(meta.token_ids)))

    def _write_file(self, block: KvBlock) -> None:
        path = self.path_of(block.key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            parts = [memoryview(block_file.header_bytes(block)), memoryview(block.payload)]
            while parts:  # writev may write less than asked
                written = os.writev(fd, parts)
                while parts and written >= len(parts[0]):
                    written -= len(parts[0])
                    parts.pop(0)
                if parts and written:
                    parts[0] = parts[0][written:]
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)

    async def write(self, block: KvBlock) -> bool:
        try:
            await asyncio.to_thread(self._write_file, block)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                self._full_at = self.used_bytes
                log.warning("disk tier %s is full at %d bytes; it counts as full", self.root, self.used_bytes)
            else:
                log.error("disk tier: cannot write block %s: %s", block.key.hex(), exc)
            return False
        self._indexed(block.key, BlockInfo.of(block))
        return True

    def _read_file(self, key: BlockKey) -> KvBlock | None:
        try:
            data = self.path_of(key).read_bytes()
        except FileNotFoundError:
            return None
        return block_file.decode(data)

    async def read(self, key: BlockKey) -> KvBlock | None:
        if key not in self:
            return None
        try:
            return await asyncio.to_thread(self._read_file, key)
        except OSError as exc:  # a BlockFormatError goes up: the store counts it as corruption
            log.warning("disk tier: block %s unreadable: %s", key.hex(), exc)
            return None

    async def delete(self, key: BlockKey) -> bool:
        held = self._unindexed(key)
        if held:
            try:
                await asyncio.to_thread(self.path_of(key).unlink, True)
            except OSError as exc:
                log.error("disk tier: cannot delete block %s: %s", key.hex(), exc)
            self._full_at = None  # room was made; let the disk tell us again if it is still full
        return held
