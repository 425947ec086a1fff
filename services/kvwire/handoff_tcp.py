"""A layer-wise handoff's KV over decode's TCP side channel: prefill and decode in separate pods
or hosts, where shared memory (``handoff_shm.py``) cannot reach and gRPC bytes move a fraction
of what a socket does.

Decode's ``OpenHandoff`` (prefill's role only) allocates one flat buffer for the handoff, laid
out as the shared memory segment is (``layer_wire.block_buffers``), and registers it with its
``SideChannelServer`` (``side_channel.py``: one-time 256-bit token, optional mutual TLS, the
listener's threads and connection slots). Prefill connects, says the token, and for every note
it puts on the Handoff stream first writes one *group* here: the bytes of that note's slice (or
of the state), each piece straight to its place in decode's buffer. The Handoff stream then
carries the same data-less notes (CRC32) as over shared memory, its header ``tcp_token``; the
n-th note is the n-th group. Decode's connection thread lands each group, taking its CRC32 as
the bytes land (still in cache: no second pass over them), then tells the event loop "groups
up to n landed"; on note n decode waits (``LAND_TIMEOUT_S`` at most) for that, then checks the
note's CRC against the group's (``LandedLayerAssembler``) and takes the slice as with shared
memory.

A group: ``seq | count | row | stride`` (4 x u32, big-endian), ``count`` x ``offset (u64) |
nbytes (u32)``, then the pieces' bytes in order. ``row == 0``: each piece lands contiguously at
its offset; else (a token-major cache, kimi_k3) a piece is rows of ``row`` bytes landing
``stride`` bytes apart. Groups come in order (``seq`` = the last landed + 1). A group whose
pieces do not all lie inside the buffer, or out of order, closes the connection before any of
its bytes is written; so does a connection without a valid token (the side channel's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np

from crescent.protos import decode_pb2
from crescent.services.kvwire.fused_copy import empty_buffer
from crescent.services.kvwire.handoff_shm import MappedLayerAssembler
from crescent.services.kvwire.layer_wire import LayerLayout
from crescent.services.kvwire.side_channel import CONNECT_TIMEOUT_S, Connection, receive_checked, receive_exact
from crescent.services.kvwire.side_channel_client import connect_to

log = logging.getLogger(__name__)

TCP_REFUSAL = "tcp handoff:"  # how decode's FAILED_PRECONDITION details start when its side channel failed
GROUP = struct.Struct("!IIII")  # seq, count, row, stride
PIECE = struct.Struct("!QI")  # offset, nbytes
MAX_PIECES = 1 << 16  # per group: a slice is at most 4 MiB of blocks
LAND_TIMEOUT_S = 10.0  # decode waits this long for a note's bytes once the note came
IDLE_TIMEOUT_S = 120.0  # between groups (a long prompt's chunk computes in between)
_IOV_MAX = 512  # buffers per sendmsg

Piece = tuple[int, memoryview]  # offset in decode's buffer, bytes


class HandoffTcpError(ConnectionError):
    """A note whose bytes did not land: the side channel broke, or was too slow."""


class HandoffLanding:
    """Decode's side of one handoff: its flat buffer and how far the groups landed in it."""

    def __init__(self, request_id: str, total_bytes: int) -> None:
        self.request_id = request_id
        self.buf = empty_buffer(total_bytes)
        self.opened_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self.landed = 0  # groups landed (1..n), on the loop
        self._crcs: dict[int, int] = {}  # CRC32 of each landed group whose note has not come yet
        self.ended = ""  # why no more groups will come ("": they may)
        self._notes = 0  # notes taken by ``wait_next``
        self._closed = threading.Event()  # the handoff is over: land nothing more

    # ---- the side channel's connection thread ----------------------------------------------------

    def serve(self, conn: Connection) -> None:
        """Land groups until prefill closes the connection (``SideChannelServer.expect_stream``)."""
        try:
            self._serve(conn)
        except BaseException as exc:
            self._tell(self._end, f"the side channel failed: {exc}")
            raise
        self._tell(self._end, "prefill closed the side channel")

    def _serve(self, conn: Connection) -> None:
        conn.settimeout(IDLE_TIMEOUT_S)
        head = bytearray(GROUP.size)
        expected = 1
        while not self._closed.is_set():
            got = conn.recv_into(memoryview(head), len(head))
            if got == 0:
                return  # closed between groups: a normal end
            receive_exact(conn, memoryview(head)[got:])
            seq, count, row, stride = GROUP.unpack(head)
            if seq != expected or count > MAX_PIECES:
                raise ValueError(f"group {seq} of {count} pieces; group {expected} of at most {MAX_PIECES} expected")
            table = bytearray(PIECE.size * count)
            receive_exact(conn, memoryview(table))
            pieces = [PIECE.unpack_from(table, i * PIECE.size) for i in range(count)]
            for offset, nbytes in pieces:  # every piece checked before any byte lands
                self._check(offset, nbytes, row, stride)
            crc = 0
            for offset, nbytes in pieces:
                crc = self._land(conn, offset, nbytes, row, stride, crc)
            self._tell(self._advance, (seq, crc))
            expected += 1

    def _check(self, offset: int, nbytes: int, row: int, stride: int) -> None:
        if not row:
            end = offset + nbytes
        elif nbytes % row or row > stride:
            raise ValueError(f"a piece of {nbytes} bytes in rows of {row} every {stride}")
        else:
            end = offset + (nbytes // row - 1) * stride + row if nbytes else offset
        if end > len(self.buf):
            raise ValueError(f"a piece [{offset}, {end}) outside the handoff's {len(self.buf)} bytes")

    def _land(self, conn: Connection, offset: int, nbytes: int, row: int, stride: int, crc: int) -> int:
        """Land one piece; the CRC32 of the group so far, continued over its bytes as they came."""
        if not row:
            return receive_checked(conn, self.buf[offset : offset + nbytes], crc)
        rows = empty_buffer(nbytes)  # a token-major layer: its rows land strided
        crc = receive_checked(conn, rows, crc)
        count = nbytes // row
        if count:
            target = np.ndarray((count, row), dtype=np.uint8, buffer=self.buf, offset=offset, strides=(stride, 1))
            target[:] = np.frombuffer(rows, dtype=np.uint8).reshape(count, row)
        return crc

    def _tell(self, fn, arg) -> None:  # noqa: ANN001 - one of the loop-side methods below
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits
            self._loop.call_soon_threadsafe(fn, arg)

    # ---- the event loop --------------------------------------------------------------------------

    def _advance(self, landed: tuple[int, int]) -> None:
        seq, crc = landed
        self.landed = max(self.landed, seq)
        self._crcs[seq] = crc
        self._changed.set()

    def _end(self, why: str) -> None:
        if not self.ended:
            self.ended = why
        self._changed.set()

    async def wait_next(self, timeout_s: float = LAND_TIMEOUT_S) -> None:
        """Wait until the next note's group landed; ``HandoffTcpError`` if it will not (the
        connection ended before it, or ``timeout_s`` passed)."""
        self._notes += 1
        seq, deadline = self._notes, self._loop.time() + timeout_s
        while self.landed < seq:
            if self.ended:
                raise HandoffTcpError(f"{self.ended} before the bytes of note {seq} landed")
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                raise HandoffTcpError(f"the bytes of note {seq} did not land within {timeout_s:g} s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def note_crc(self) -> int:
        """The CRC32 of the group of the note ``wait_next`` last waited for (once)."""
        return self._crcs.pop(self._notes)

    def close(self) -> None:
        """The handoff is over (taken or refused): the connection lands nothing more."""
        self._closed.set()


class LandedLayerAssembler(MappedLayerAssembler):
    """A ``MappedLayerAssembler`` over a landing's buffer whose notes' CRCs are checked against
    those taken as each group landed (the servicer waits for each note's group first)."""

    where = "the side channel's buffer"

    def __init__(self, layout: LayerLayout, prompt_tokens: int, block_size: int, landing: HandoffLanding) -> None:
        super().__init__(layout, prompt_tokens, block_size, landing.buf)
        self.landing = landing

    def _slice_crc(self, meta: decode_pb2.LayerSliceMeta) -> int:  # noqa: ARG002 - the group is the slice
        return self.landing.note_crc()

    def _state_crc(self, head: int) -> int:  # noqa: ARG002
        return self.landing.note_crc()


class HandoffSender:
    """Prefill's side of one handoff: a thread writing groups to decode's side channel in order,
    off the event loop. ``connect`` (blocking) first; a failure later is kept in ``error`` and
    stops the sending: decode then refuses the note it cannot check, and prefill resends."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[int, int, int, list[Piece]] | None] = queue.SimpleQueue()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="handoff-tcp-send", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, address: str, token: bytes, client_tls: ssl.SSLContext | None = None,
                server_name: str = "") -> HandoffSender:
        """Connect to decode's side channel at ``address`` and open the handoff of ``token``."""
        conn, _ = connect_to(address, CONNECT_TIMEOUT_S, client_tls, server_name, receiving=False)
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            conn.sendall(token + bytes([0, 1]))  # the side channel's hello: stripe 0 of 1
        except BaseException:
            conn.close()
            raise
        return cls(conn)

    def send(self, seq: int, pieces: list[Piece], row: int = 0, stride: int = 0) -> None:
        """Queue group ``seq``: ``pieces`` (kept unchanged until sent) to their offsets."""
        self._queue.put((seq, row, stride, pieces))

    def close(self, abort: bool = False) -> None:
        """Close the connection once the queued groups are sent (``abort``: at once)."""
        self._stop = self._stop or abort
        self._queue.put(None)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None and not self._stop:
                seq, row, stride, pieces = item
                table = b"".join(PIECE.pack(offset, len(data)) for offset, data in pieces)
                _send_views(self._conn, [GROUP.pack(seq, len(pieces), row, stride) + table, *(d for _, d in pieces)])
        except (OSError, ssl.SSLError) as exc:
            self.error = exc
            log.warning("handoff side channel: %s", exc)
        finally:
            self._conn.close()


def _send_views(conn: Connection, views: Sequence[bytes | memoryview]) -> None:
    """Every byte of ``views`` in order: a plain socket gathers them (``sendmsg``), TLS sends each."""
    if not isinstance(conn, socket.socket) or isinstance(conn, ssl.SSLSocket):
        for view in views:
            conn.sendall(view)
        return
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    first = 0
    while first < len(pending):
        sent = conn.sendmsg(pending[first : first + _IOV_MAX])
        while first < len(pending) and sent >= len(pending[first]):
            sent -= len(pending[first])
            first += 1
        if sent:
            pending[first] = pending[first][sent:]
