"""One Redis connection for the calls a gateway does not wait for (settles, admissions taken
from its view): written in order, answered in order, read by one task.

Borrowing a pooled connection per call costs more than the write itself (redis-py checks the
connection and records pool metrics on every borrow); a request's path should pay only the
write. Redis answers a connection's commands in the order it received them, so each call's
future is queued before its bytes go out and the reader hands answers to futures in turn.
"""

from __future__ import annotations

import asyncio
from collections import deque

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import RedisError, ResponseError


class RedisPipe:
    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._connection: AbstractConnection | None = None
        self._waiting: deque[asyncio.Future[object]] = deque()
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()  # two first sends must not open two connections

    async def send(self, *args: object) -> asyncio.Future[object]:
        """Write one command; on return Redis has it ahead of anything sent later. The future is
        its answer (a Redis error reply, e.g. NOSCRIPT, as its exception)."""
        if self._connection is None:
            async with self._connecting:
                if self._connection is None:
                    fresh = self._pool.make_connection()
                    await fresh.connect()
                    self._connection = fresh
        connection = self._connection
        answer: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)  # before the write: the answer may be read as soon as it is sent
        try:
            await connection.send_command(*args)
        except BaseException as exc:
            self._broken(connection, exc)
            raise
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(connection))
        return answer

    async def _read(self, connection: AbstractConnection) -> None:
        try:
            while self._waiting and connection is self._connection:
                try:
                    reply = await connection.read_response()  # within the store's socket timeout
                except ResponseError as exc:  # one command's error reply: the connection goes on
                    self._waiting.popleft().set_exception(exc)
                    continue
                except (RedisError, OSError, TimeoutError) as exc:
                    self._broken(connection, exc)
                    return
                answer = self._waiting.popleft()
                if not answer.done():
                    answer.set_result(reply)
        finally:
            if self._reader is asyncio.current_task():
                self._reader = None

    def _broken(self, connection: AbstractConnection, exc: BaseException) -> None:
        """Fail every call still waiting on ``connection`` and start afresh on the next send."""
        if connection is not self._connection:
            return
        self._connection = None
        self._reader = None  # the old reader sees the new connection and stops
        while self._waiting:
            answer = self._waiting.popleft()
            if not answer.done():
                answer.set_exception(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
        asyncio.get_running_loop().create_task(connection.disconnect())

    async def close(self) -> None:
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._connection is not None:
            await self._connection.disconnect()
            self._connection = None
