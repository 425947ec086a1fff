"""What vLLM's own cache holds, from its scheduler process to the instance's scheduler agent.

vLLM's scheduler runs in a process of its own (the engine core), where the connector's scheduler
side sees which prompt blocks vLLM has computed and which it has since evicted. It sends those
as ``BlockEventBatch`` messages (Crescent block keys, tier ENGINE) over a Unix socket the
instance listens on; the instance keeps the set they describe and hands it to its scheduler
agent, which publishes it exactly as a native instance's block events (and its snapshot on a
re-registration). Frames: a 4-byte little-endian length, then the serialized batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import struct
import threading

from crescent.protos import common_pb2

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 16 * 1024 * 1024


class BlockEventSender:
    """The connector's side: ``send`` never blocks vLLM's scheduler; a thread writes the frames
    and reconnects when the instance restarts its listener."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="crescent-block-events", daemon=True)
        self._thread.start()

    def send(self, events: list[common_pb2.BlockEvent]) -> None:
        if events:
            self._queue.put(common_pb2.BlockEventBatch(events=events).SerializeToString())

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        sock: socket.socket | None = None
        while True:
            frame = self._queue.get()
            if frame is None:
                break
            for _ in range(2):  # one reconnect per frame: the instance may have restarted its listener
                try:
                    if sock is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.connect(self.path)
                    sock.sendall(_LENGTH.pack(len(frame)) + frame)
                    break
                except OSError as exc:
                    log.warning("block events to %s: %s", self.path, exc)
                    if sock is not None:
                        sock.close()
                    sock = None
        if sock is not None:
            sock.close()


class EngineBlockSet:
    """The instance's side: the blocks vLLM holds now, and the events since the last drain."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[bytes, bytes] = {}  # key -> parent key
        self._pending: list[common_pb2.BlockEvent] = []
        self._server: asyncio.AbstractServer | None = None

    def apply(self, batch: common_pb2.BlockEventBatch) -> None:
        for event in batch.events:
            if event.kind == common_pb2.BLOCK_EVENT_STORED:
                if event.key in self.held:
                    continue
                self.held[event.key] = event.parent_key
            elif event.kind == common_pb2.BLOCK_EVENT_REMOVED:
                if self.held.pop(event.key, None) is None:
                    continue
            self._pending.append(event)

    def drain_events(self) -> list[common_pb2.BlockEvent]:
        events, self._pending = self._pending, []
        return events

    def snapshot(self) -> list[common_pb2.BlockEvent]:
        return [common_pb2.BlockEvent(kind=common_pb2.BLOCK_EVENT_STORED, key=key, parent_key=parent,
                                      tier=common_pb2.KV_TIER_ENGINE, num_tokens=self.block_size)
                for key, parent in self.held.items()]

    async def listen(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._read, path=path)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if length > MAX_FRAME_BYTES:
                    log.warning("block events: a %d-byte frame; closing", length)
                    return
                self.apply(common_pb2.BlockEventBatch.FromString(await reader.readexactly(length)))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the connector went away, or this listener is closing
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
