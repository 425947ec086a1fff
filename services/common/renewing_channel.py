"""A client channel that re-opens itself when the process's certificate is renewed.

A gRPC channel's credentials are fixed when it is opened, and a channel reconnects with them
after every network blip or server restart: a channel older than its certificate would fail
every handshake from then on. ``RenewingChannel`` looks at ``PeerTls.latest`` on each call and,
when the key pair changed, opens a new channel with it; the old one is closed after
``RETIRE_AFTER_S`` so calls already on it finish. Stubs built on it keep working across renewals:
each multicallable it hands out binds to whichever channel is current when it is called.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc

from crescent.services.common.tls import PeerTls

RETIRE_AFTER_S = 60.0


class RenewingChannel:
    """Duck-types ``grpc.aio.Channel`` for stubs; ``open`` makes one real channel per key pair."""

    def __init__(self, tls: PeerTls, open_with: Callable[[PeerTls], grpc.aio.Channel]) -> None:
        self._tls = tls
        self._open_with = open_with
        self._pair = tls.latest()
        self._channel = open_with(self._pair)
        self._retiring: set[asyncio.Task[None]] = set()
        self._retired: list[grpc.aio.Channel] = []

    def current(self) -> grpc.aio.Channel:
        latest = self._tls.latest()
        if latest is not self._pair:
            old, self._pair = self._channel, latest
            self._channel = self._open_with(latest)
            self._retire(old)
        return self._channel

    def _retire(self, channel: grpc.aio.Channel) -> None:
        self._retired.append(channel)

        async def close_later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            with contextlib.suppress(ValueError):
                self._retired.remove(channel)
            await channel.close()

        try:
            task = asyncio.get_running_loop().create_task(close_later())
        except RuntimeError:  # no loop (a synchronous caller): closed with the rest in close()
            return
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def unary_unary(self, *args: Any, **kwargs: Any) -> _Multicallable:
        return _Multicallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _Multicallable:
        return _Multicallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _Multicallable:
        return _Multicallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _Multicallable:
        return _Multicallable(self, "stream_stream", args, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        for task in list(self._retiring):
            task.cancel()
        channels, self._retired = [*self._retired, self._channel], []
        for channel in channels:
            await channel.close(grace)

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Multicallable:
    """One method of a stub, bound to the owner's current channel at each call."""

    def __init__(self, owner: RenewingChannel, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._bound: tuple[grpc.aio.Channel | None, Any] = (None, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        if self._bound[0] is not channel:
            self._bound = (channel, getattr(channel, self._kind)(*self._args, **self._kwargs))
        return self._bound[1](*args, **kwargs)
