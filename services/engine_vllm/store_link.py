"""The kvstore as vLLM's connector reaches it: a ``KvStoreClient`` (every byte mover: shared
memory on one host, the TCP side channel, NIXL, gRPC) on an event loop thread of its own, called
synchronously from vLLM's scheduler and workers, which have no loop of theirs to lend.

The store is only a cache: every failure is a miss or a dropped put, logged, never raised into
a step. Puts do not hold the step: they are queued and sent in the background, a bounded number
at a time; a put that finds the queue full is dropped (the block is recomputed some day), or on a
prefill instance waits for room (its saves are its handoffs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from crescent.services.common.tls import TlsSettings, load_tls
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0   # a lookup that takes longer is a miss: the step must not wait on a slow node
GET_TIMEOUT_S = 30.0
MAX_PUTS_IN_FLIGHT = 64  # blocks queued for the store; beyond this new ones are dropped (or wait)
PUT_ROOM_TIMEOUT_S = 30.0  # the longest a prefill's step waits for room in the queue


class StoreLink:
    def __init__(self, options: ConnectorOptions) -> None:
        self.options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="crescent-kvstore-link", daemon=True)
        self._thread.start()
        tls = load_tls(TlsSettings(ca=options.tls_ca, cert=options.tls_cert, key=options.tls_key,
                                   server_name=options.tls_server_name))
        self._client: KvStoreClient = self._call(self._make_client(tls), 10.0)
        self._puts_in_flight = 0
        self._room = threading.Condition()
        self.dropped_puts = 0

    async def _make_client(self, tls) -> KvStoreClient:  # noqa: ANN001 - PeerTls | None
        return KvStoreClient(self.options.kvstore_address, shared_memory=self.options.kvstore_shared_memory, tls=tls)

    def _call(self, coro, timeout_s: float):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the store holds now (none on any failure)."""
        if not keys:
            return []
        try:
            found = self._call(self._client.exists([BlockKey(k) for k in keys], self.options.model_id),
                               LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a lookup that failed is a miss
            log.warning("kvstore lookup failed (a miss): %s", exc)
            return [False] * len(keys)
        return [bool(f) for f in found]

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds now (0 on any failure)."""
        hits = 0
        for here in self.present(keys):
            if not here:
                break
            hits += 1
        return hits

    def get_prefix(self, keys: Sequence[BlockKey]) -> list[KvBlock]:
        """The leading blocks of ``keys`` the store returns, each verified (fewer on any failure)."""
        try:
            return self._call(self._client.get_prefix(keys, self.options.model_id, self.options.lease_ms),
                              GET_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed
            log.warning("kvstore get failed (recomputed): %s", exc)
            return []

    def put_soon(self, blocks: list[KvBlock]) -> Future | None:
        """Send ``blocks`` in the background; None when too many are already on their way (or,
        with ``saves_wait``, when there was still no room after ``PUT_ROOM_TIMEOUT_S``)."""
        with self._room:
            if self.options.saves_wait:
                self._room.wait_for(lambda: self._puts_in_flight == 0
                                    or self._puts_in_flight + len(blocks) <= MAX_PUTS_IN_FLIGHT, PUT_ROOM_TIMEOUT_S)
            if self._puts_in_flight and self._puts_in_flight + len(blocks) > MAX_PUTS_IN_FLIGHT:
                self.dropped_puts += len(blocks)
                log.warning("kvstore puts backed up; %d block(s) not stored", len(blocks))
                return None
            self._puts_in_flight += len(blocks)
        future = asyncio.run_coroutine_threadsafe(self._put(blocks), self._loop)
        return future

    async def _put(self, blocks: list[KvBlock]) -> None:
        try:
            result = await self._client.put(blocks)
            if result.failed or result.rejected:
                log.warning("kvstore stored %d of %d block(s)", result.stored, len(blocks))
        except Exception as exc:  # noqa: BLE001 - a lost put is a future miss
            log.warning("kvstore put failed: %s", exc)
        finally:
            with self._room:
                self._puts_in_flight -= len(blocks)
                self._room.notify_all()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued put has been answered (tests, shutdown)."""
        async def idle() -> None:
            while self._puts_in_flight:
                await asyncio.sleep(0.005)
        self._call(idle(), timeout_s)

    def close(self) -> None:
        try:
            self.flush(5.0)  # blocks already handed over reach the store before vLLM exits
        except Exception:  # noqa: BLE001 - closing at shutdown: what did not make it is a future miss
            log.warning("kvstore puts still in flight at shutdown were dropped")
        try:
            self._call(self._client.close(), 5.0)
        except Exception:  # noqa: BLE001 - closing at shutdown
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
