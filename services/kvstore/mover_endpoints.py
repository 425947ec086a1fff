"""The node's ends of the byte movers that need one: the TCP side channel and the NIXL target.

Both serve room reserved in the first tier's host pool (``ReserveShm``) and hand their
coordinates back in the reserve reply; the servicer keeps the control calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from crescent.services.common.metrics import kvstore_metrics
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.common.tls import PeerTls, is_loopback
from crescent.services.kvstore.config import KvStoreSettings
from crescent.services.kvstore.reservations import Landing
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.nixl_engine import NixlEngine, NixlUnavailable, address_of
from crescent.services.kvwire.side_channel import SideChannelServer, SideTls

log = logging.getLogger(__name__)


class NixlTarget:
    """The host pool registered with this node's NIXL agent, for clients' one-sided writes."""

    def __init__(self, pool: memoryview) -> None:
        self.engine = NixlEngine("kvstore", progress_thread=True)
        self.base = address_of(pool)
        self._registered = self.engine.register([(self.base, len(pool))])
        self.metadata = self.engine.metadata()

    def close(self) -> None:
        self.engine.deregister(self._registered)


class MoverEndpoints:
    def __init__(self, settings: KvStoreSettings, host: HostTier | None, tls: PeerTls | None,
                 on_refused) -> None:  # noqa: ANN001 - a no-argument callable
        self.side: SideChannelServer | None = None
        self.side_address = ""
        self.nixl: NixlTarget | None = None
        side = settings.side_channel
        if side.enabled and host is not None:
            listen_host = side.host or settings.listen.host
            use_tls = tls is not None and side.tls
            if tls is not None and not side.tls:
                log.warning("side channel without TLS (side_channel.tls: false): KV payloads cross the network "
                            "in the clear; a one-time token still authenticates each transfer")
            self.side = SideChannelServer(listen_host, side.port, server_tls=SideTls(tls) if use_tls else None,
                                          timeout_s=side.timeout_s, on_refused=on_refused,
                                          on_accepted=kvstore_metrics().side_channel_connections.inc)
            advertise = side.advertise_host or (settings.advertise_address.rpartition(":")[0]
                                                if settings.advertise_address else listen_host)
            self.side_address = f"{'tls://' if use_tls else ''}{advertise}:{self.side.port}"
            log.info("side channel on %s:%d (%s)", listen_host, self.side.port,
                     "mutual TLS + one-time tokens" if use_tls else "one-time tokens"
                     + ("" if is_loopback(listen_host) else ", payloads in the clear"))
        if settings.nixl and host is not None:
            try:
                self.nixl = NixlTarget(host.pool.buf)
                log.info("NIXL mover served: host pool registered at %#x", self.nixl.base)
            except NixlUnavailable as exc:
                log.warning("nixl is set but NIXL cannot start here (%s); serving the other movers", exc)
        self._sends: set[asyncio.Task[None]] = set()  # side-channel gets: unpin when sent

    async def landed(self, landing: Landing, granted: int) -> list[bool | None]:
        """Per granted slot, whether its payload arrived over the side channel with the header's
        CRC (False: damaged on the way); None for all when the transfer never started, failed,
        or was cut short (nothing usable arrived)."""
        if self.side is not None and self.side.withdraw(landing.token):
            return [None] * granted  # nobody opened it: nothing was written
        try:
            return list(await landing.done)
        except (ConnectionError, asyncio.CancelledError) as exc:
            log.warning("side-channel put did not complete: %s", exc)
            return [None] * granted

    def send_then_unpin(self, store: TieredStore, keys: list[BlockKey], payloads: Sequence[memoryview],
                        wait_s: float) -> bytes:
        """Register a side-channel send of ``payloads`` (of the pinned blocks ``keys``); the
        token that opens it. The blocks are unpinned once sent, or once nobody came for them
        within ``wait_s``."""
        assert self.side is not None
        token, sent = self.side.expect_send(payloads)
        task = asyncio.get_running_loop().create_task(self._unpin_when_sent(store, token, sent, keys, wait_s),
                                                      name="side-send")
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return token

    async def _unpin_when_sent(self, store: TieredStore, token: bytes, sent: asyncio.Future, keys: list[BlockKey],
                               wait_s: float) -> None:
        assert self.side is not None
        try:
            try:
                await asyncio.wait_for(asyncio.shield(sent), wait_s)
            except TimeoutError:
                if not self.side.withdraw(token):
                    await sent  # it started: the socket's timeout ends it
        except (ConnectionError, asyncio.CancelledError) as exc:
            log.warning("side-channel get of %d blocks did not complete: %s", len(keys), exc)
        finally:
            for key in keys:
                store.unpin(key)

    async def close(self) -> None:
        await cancel_and_wait(*self._sends)
        if self.side is not None:
            self.side.close()
        if self.nixl is not None:
            self.nixl.close()
