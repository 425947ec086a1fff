"""Lifecycle of a gRPC service process: gRPC server, admin HTTP, signals, clean stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc

from crescent.services.common.access import interceptors
from crescent.services.common.admin_http import AdminServer, build_admin_app
from crescent.services.common.renewing_channel import RenewingChannel
from crescent.services.common.settings import ListenSettings
from crescent.services.common.tls import PeerTls, TlsSettings, check_listen, load_tls

log = logging.getLogger(__name__)

# KV blocks travel as messages of a few MB; leave room for large blocks (64 MiB) and headers.
MAX_MESSAGE_BYTES = 80 * 1024 * 1024
# A peer whose host vanishes without closing TCP (node loss) is noticed by keepalive pings
# within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of at the call's deadline; callers
# then migrate or retry. Clients ping only while a call is open; servers accept those pings
# however long a stream stays silent (a request waiting for decode KV sends nothing).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def open_channel(address: str, tls: PeerTls | None, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """The one way to open a client channel: mutual TLS when ``tls`` is given (the process's
    key pair), plaintext otherwise; Crescent's message limits unless ``options`` replaces them."""
    opts = list(GRPC_OPTIONS if options is None else options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    if tls.files is None:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    # Read from files: the channel re-opens itself with a renewed certificate (renewing_channel).
    renewing = RenewingChannel(tls, lambda pair: grpc.aio.secure_channel(address, pair.channel_credentials(),
                                                                         options=opts))
    return cast(grpc.aio.Channel, renewing)


class ChannelPool:
    """One client channel per peer address, opened on first use with ``open_channel``, closed together."""

    def __init__(self, tls: PeerTls | None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class GrpcService:
    """Owns a service's gRPC server and admin HTTP server for the life of the process.

    ``setup`` registers servicers on the server and may start background work; ``cleanup``
    stops that work. ``ready`` tells ``/health`` whether to answer 200.

    Security: with ``tls`` configured the server requires mutual TLS and every call passes the
    role check of ``access.py`` first; ``self.tls`` is the process's key pair for the owner's own
    client channels (``open_channel``). Without TLS it serves plaintext, on loopback only unless
    ``tls.allow_plaintext_non_loopback`` (``tls.check_listen``).

    Draining: ``draining = True`` turns ``/health`` to 503 at once while the gRPC server keeps
    serving what is in flight; the owner calls ``stop`` (whose grace is short) only once its
    drain is over (see instance/shell.py).
    """

    def __init__(
        self,
        name: str,
        listen: ListenSettings,
        setup: Callable[[grpc.aio.Server], Awaitable[None]],
        cleanup: Callable[[], Awaitable[None]] | None = None,
        ready: Callable[[], bool] = lambda: True,
        details: Callable[[], dict[str, Any]] | None = None,
        on_started: Callable[[GrpcService], Awaitable[None]] | None = None,
        tls: TlsSettings = TlsSettings(),
    ) -> None:
        check_listen(name, listen.host, tls)  # before anything starts: plaintext only on loopback
        self.name = name
        self.listen = listen
        self._setup = setup
        self._cleanup = cleanup
        self._ready = ready
        self._on_started = on_started
        self._started = False
        self.draining = False
        # This process's key pair: the server's credentials and its owner's client channels.
        self.tls = load_tls(tls)
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors(self.tls is not None))
        self.admin = AdminServer(
            build_admin_app(name, lambda: self._started and not self.draining and self._ready(), details),
            listen.admin_host or listen.host, listen.admin_port,
        )
        self.port = listen.port
        self.admin_port = listen.admin_port

    async def start(self) -> None:
        await self._setup(self.server)
        address = f"{self.listen.host}:{self.listen.port}"
        if self.tls is None:
            bound = self.server.add_insecure_port(address)
        else:
            bound = self.server.add_secure_port(address, self.tls.server_credentials())
        if bound == 0:
            raise RuntimeError(f"{self.name}: cannot listen on {self.listen.host}:{self.listen.port} (listen.port)")
        self.port = bound
        await self.server.start()
        self.admin_port = await self.admin.start()
        self._started = True
        log.info("%s serving gRPC (%s) on %s:%d, admin HTTP on :%d", self.name,
                 "mutual TLS" if self.tls else "plaintext, unauthenticated", self.listen.host, self.port, self.admin_port)
        if self._on_started is not None:
            await self._on_started(self)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop the gRPC server (calls still open get ``grace_s`` to end), then the rest."""
        self.draining = True
        self._started = False
        await self.server.stop(grace_s)
        if self._cleanup is not None:
            await self._cleanup()
        await self.admin.stop()
        log.info("%s stopped", self.name)

    async def run_until_signalled(self) -> None:
        """Start, serve until SIGINT or SIGTERM, then stop cleanly (the loop must own the main thread)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.run_until(stop)

    async def run_until(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` is set, then stop cleanly."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
