"""A TCP side channel for KV payloads, under gRPC control calls.

gRPC over loopback moves a fifth of a memcpy here at best, bare grpcio's own ceiling; a plain
socket moves two to three times that. So the bytes of a transfer go over sockets of their own
while gRPC keeps the control: a reserve (or get) call over the authenticated gRPC channel
registers the transfer here and hands the caller a one-time token; the caller connects, sends
the token, then the payloads (or reads them); the commit call goes over gRPC again.

- **Authentication.** A connection must open with a token this server issued for a transfer
  not yet fully opened: anything else is closed at once, having written nothing anywhere.
  Tokens are 256 random bits, live until their transfer's reservation expires, and are handed
  out only by calls that passed mutual TLS and the role check (``access.py``), so holding one
  proves the same. With ``tls`` the sockets are also wrapped in mutual TLS with the process's
  own certificate, for networks where the payloads must not be read on the way. The receiving
  end of a TLS connection (always the node; a client only for gets) reads the ciphertext in
  large pieces through memory BIOs (``tls_stream.py``) rather than a record per call.
- **Stripes.** A transfer of at least ``MIN_STRIPED_BYTES`` goes over ``STRIPES`` connections
  at once, each carrying an equal, contiguous share of the payloads laid end to end: one
  loopback connection moves ~4 GB/s here, two ~5.4 (measured 2026-12-02 on the 2-core VM).
- **Receiving.** Payloads land straight in their destination (room reserved in the host pool),
  a slice at a time, each slice's CRC32 computed while it is still in cache; stripes' CRCs are
  joined with ``crc32_combine``. A payload whose CRC is not its header's is reported bad and
  never committed. The receiver answers one byte per payload (1 good, 0 bad) on every stripe.
- **Sending.** Payloads go out of the buffers they are in (``sendall`` of memoryview slices).

- **Kept connections.** A client marks its hello ``KEEP_FLAG`` and, once the transfer is over,
  keeps the connection (at most ``MAX_IDLE_PER_PEER`` per node and direction, for
  ``CLIENT_IDLE_S``) for the next transfer's hello, so a call pays no TCP connect or TLS
  handshake (2.5 ms of mutual TLS here). The node waits ``IDLE_TIMEOUT_S`` for it; an idle
  connection holds no connection slot. A kept connection that turns out closed is retried once
  on a fresh one: if the node had read the hello on the dead one, the token's stripe is open
  and the retry is refused, so no byte is ever written twice.

- **Streams.** ``expect_stream`` registers a transfer of one connection whose bytes a callback
  reads itself on the connection's thread, once the token (and TLS) let it in: the layer-wise
  handoff's groups, whose sizes come as prefill computes (``handoff_tcp.py``).

Frames, per transfer: ``token (32 bytes) | stripe index (1) | stripe count (1, | KEEP_FLAG)``,
then that stripe's bytes (sizes are known to both sides from the control call), then for a
receive the result bytes back; on a kept connection the next hello follows.

The server runs a thread per connection (blocking socket calls and the CRC release the GIL) and
reports each transfer's outcome to the asyncio loop that registered it. The client's half (dialing,
stripes, kept connections) is ``side_channel_client.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crescent.services.common.tls import PeerTls
from crescent.services.kvwire.fused_copy import SLICE_BYTES, crc32, crc32_combine
from crescent.services.kvwire.tls_stream import TlsStream

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
HELLO_BYTES = TOKEN_BYTES + 2  # token, stripe index, stripe count
STRIPES = 2                    # connections per large transfer (best of 1-4 on the 2-core VM)
MAX_STRIPES = 8
MIN_STRIPED_BYTES = 8 << 20    # below this one connection is as fast
TOKEN_TIMEOUT_S = 5.0          # a connection that has not said who it is (TLS and token) within this is cut
HANDSHAKES_PER_SLOT = 4        # connections allowed to be saying who they are, per transfer slot
CONNECT_TIMEOUT_S = 2.0        # no answer to connect within this: unreachable (a firewall drops it)
KEEP_FLAG = 0x80               # in the hello's stripe count: the client will reuse the connection
IDLE_TIMEOUT_S = 30.0          # the node closes a kept connection with no next hello within this
CLIENT_IDLE_S = 20.0           # a client reuses a kept connection idle for less (well inside the node's)
MAX_IDLE_PER_PEER = STRIPES    # kept connections a client holds per node and direction
_RECEIVE, _SEND, _STREAM = "receive", "send", "stream"

Piece = tuple[int, int, int]  # payload index, start, end (bytes of that payload)


class SideChannelError(ConnectionError):
    """A transfer that did not complete (refused, cut short, timed out)."""


class SideChannelUnreachable(SideChannelError):
    """The side channel cannot be reached at all from here (refused, or no answer to connect
    within ``CONNECT_TIMEOUT_S``: a firewall or network policy in between)."""


def tls_contexts(tls: PeerTls) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS with the process's key pair: the same CA, the
    same certificates as its gRPC channels. (ssl reads a key pair only from files: they are
    written to a private temporary folder for the load and removed.)"""
    with tempfile.TemporaryDirectory(prefix="crescent-tls-") as folder:
        cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        contexts = []
        for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
            context = ssl.SSLContext(purpose)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert, key)
            context.load_verify_locations(cadata=tls.ca.decode())
            context.verify_mode = ssl.CERT_REQUIRED
            contexts.append(context)
    return contexts[0], contexts[1]


class SideTls:
    """The side channel's (server, client) SSL contexts of the process's key pair, built anew when
    the pair is renewed (``PeerTls.latest``): each new connection gets the current ones."""

    def __init__(self, tls: PeerTls) -> None:
        self._tls = tls
        self._pair: PeerTls | None = None
        self._contexts: tuple[ssl.SSLContext, ssl.SSLContext] | None = None
        self._lock = threading.Lock()  # accept threads ask together

    def _current(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        latest = self._tls.latest()
        with self._lock:
            if latest is not self._pair or self._contexts is None:
                self._contexts, self._pair = tls_contexts(latest), latest
            return self._contexts

    def server(self) -> ssl.SSLContext:
        return self._current()[0]

    def client(self) -> ssl.SSLContext:
        return self._current()[1]


def stripe_pieces(sizes: Sequence[int], stripe: int, stripes: int) -> list[Piece]:
    """The bytes stripe ``stripe`` of ``stripes`` carries, as pieces of payloads in order: an
    equal share (whole slices) of the payloads laid end to end."""
    total = sum(sizes)
    share = -(-total // stripes)
    share = -(-share // SLICE_BYTES) * SLICE_BYTES
    begin, end = stripe * share, min(total, (stripe + 1) * share)
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        lo, hi = max(begin, offset), min(end, offset + size)
        if lo < hi:
            pieces.append((index, lo - offset, hi - offset))
        offset += size
    return pieces


def stripes_for(total_bytes: int) -> int:
    return STRIPES if total_bytes >= MIN_STRIPED_BYTES else 1


def joined_crcs(count: int, parts: Sequence[tuple[Piece, int]]) -> list[int]:
    """Each payload's CRC32 from the CRCs of its pieces (any order of arrival)."""
    crcs: list[int | None] = [None] * count
    for (index, start, end), crc in sorted(parts, key=lambda p: p[0]):
        before = crcs[index]
        crcs[index] = crc if before is None else crc32_combine(before, crc, end - start)
    return [0 if c is None else c for c in crcs]  # None: an empty payload, whose CRC is 0


def tune_socket(sock: socket.socket) -> None:
    # No SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's autotuning, which does better
    # (4.0 GB/s autotuned against 2.9-3.2 with 4 MiB buffers on loopback here).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


Connection = socket.socket | TlsStream  # what the transfer code reads and writes


def receive_exact(sock: Connection, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        got = sock.recv_into(view[pos:], len(view) - pos)
        if got == 0:
            raise SideChannelError(f"the peer closed the side channel {len(view) - pos} bytes short")
        pos += got


def _cut(raw: socket.socket) -> None:
    """End a connection's blocking reads from another thread (close alone would not wake them)."""
    try:
        raw.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def _next_hello(conn: Connection, hello: bytearray) -> bool:
    """Read the next transfer's hello on a kept connection into ``hello``; False when the client
    closed it or left it idle past its timeout (a normal end, not a refusal)."""
    view = memoryview(hello)
    try:
        got = conn.recv_into(view, len(view))
        if got == 0:
            return False
        receive_exact(conn, view[got:])
    except (OSError, ssl.SSLError):
        return False
    return True


def receive_checked(sock: Connection, into: memoryview, crc: int = 0) -> int:
    """Fill ``into`` from ``sock`` and return the CRC32 of the bytes (continuing ``crc``), each
    slice checksummed as it lands (still in cache)."""
    into = into.cast("B") if into.format != "B" else into
    for start in range(0, len(into), SLICE_BYTES):
        piece = into[start : start + SLICE_BYTES]
        receive_exact(sock, piece)
        crc = crc32(piece, crc)
    return crc


def receive_pieces(sock: Connection, buffers: Sequence[memoryview], pieces: list[Piece]) -> list[tuple[Piece, int]]:
    return [((i, a, b), receive_checked(sock, buffers[i][a:b])) for i, a, b in pieces]


def send_pieces(sock: Connection, buffers: Sequence[bytes | memoryview], pieces: list[Piece]) -> None:
    for i, a, b in pieces:
        sock.sendall(memoryview(buffers[i])[a:b])


@dataclass(eq=False)
class _Transfer:
    kind: str
    buffers: list[memoryview]
    checksums: list[int]             # receive: what each payload's CRC must be
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future = field(init=False)
    token: bytes = b""
    stripes: int = 0                 # set by the first connection
    opened: set[int] = field(default_factory=set)
    finished: int = 0
    parts: list[tuple[Piece, int]] = field(default_factory=list)
    results: bytes | None = None     # receive: one byte per payload, once every stripe is in
    over: threading.Event = field(default_factory=threading.Event)
    serve: Callable[[Connection], None] | None = None  # stream: reads its one connection itself

    def __post_init__(self) -> None:
        self.done = self.loop.create_future()

    def finish(self, result: object = None, error: BaseException | None = None) -> None:
        self.over.set()

        def settle() -> None:
            if self.done.done():
                return
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(result)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed (its owner stopped) while the bytes moved: no one awaits them
            if not self.loop.is_closed():
                raise


class SideChannelServer:
    """Listens for side-channel connections and moves the payloads of registered transfers."""

    def __init__(self, host: str, port: int = 0, *, server_tls: SideTls | None = None,
                 timeout_s: float = 30.0, max_connections: int = 64,
                 on_refused: Callable[[], None] | None = None,
                 on_accepted: Callable[[], None] | None = None) -> None:
        self._tls = server_tls
        self._on_accepted = on_accepted or (lambda: None)
        self.timeout_s = timeout_s
        self._on_refused = on_refused or (lambda: None)
        self._pending: dict[bytes, _Transfer] = {}
        self._lock = threading.Lock()
        # A transfer slot is taken only once a connection's token opened a transfer; until then it
        # holds a handshake permit, for TOKEN_TIMEOUT_S at most in all, so connections that never
        # authenticate (dribbling a byte at a time) can neither hold the slots nor last.
        self._slots = threading.BoundedSemaphore(max_connections)
        self._handshakes = threading.BoundedSemaphore(max_connections * HANDSHAKES_PER_SLOT)
        self.refused = 0  # connections refused or cut before a transfer: bad or no token, no room, too slow
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self.accepted = 0  # connections taken: with kept connections, fewer than transfers
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-side-accept", daemon=True)
        self._acceptor.start()

    # -- registering transfers (on the event loop) ---------------------------------------------

    def _register(self, transfer: _Transfer) -> bytes:
        transfer.token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._pending[transfer.token] = transfer
        return transfer.token

    def _forget(self, transfer: _Transfer) -> None:
        """A transfer that ended (done or failed) opens nothing more: a late stripe must not
        write into room that may belong to another block by then."""
        with self._lock:
            if self._pending.get(transfer.token) is transfer:
                del self._pending[transfer.token]

    def expect_receive(self, buffers: Sequence[memoryview], checksums: Sequence[int]) -> tuple[bytes, asyncio.Future]:
        """A transfer into ``buffers``; its future gives one bool per payload (CRC as expected)."""
        if len(buffers) != len(checksums):
            raise ValueError(f"{len(buffers)} buffers for {len(checksums)} checksums")
        transfer = _Transfer(_RECEIVE, list(buffers), list(checksums), asyncio.get_running_loop())
        return self._register(transfer), transfer.done

    def expect_send(self, buffers: Sequence[memoryview]) -> tuple[bytes, asyncio.Future]:
        """A transfer out of ``buffers`` (kept alive and unchanged until the future is done)."""
        transfer = _Transfer(_SEND, list(buffers), [], asyncio.get_running_loop())
        return self._register(transfer), transfer.done

    def expect_stream(self, serve: Callable[[Connection], None]) -> tuple[bytes, asyncio.Future]:
        """A transfer of one connection (one stripe) whose bytes ``serve`` reads itself on the
        connection's thread, after the token (and TLS) let it in: a framed stream whose sizes
        the control call did not fix (the layer-wise handoff, ``handoff_tcp.py``). ``serve``
        sets its own timeouts; its future is done when it returns (or fails with its error)."""
        transfer = _Transfer(_STREAM, [], [], asyncio.get_running_loop(), serve=serve)
        return self._register(transfer), transfer.done

    def withdraw(self, token: bytes) -> bool:
        """Forget a transfer no connection opened; False when one has (its buffers are in use
        until its future is done)."""
        with self._lock:
            transfer = self._pending.get(token)
            if transfer is None or transfer.opened:
                return False
            del self._pending[token]
        transfer.done.cancel()
        return True

    # -- the connections (threads) --------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # too many unauthenticated at once: the client falls back to another mover this time
                self._refuse("too many connections saying who they are")
                continue
            self.accepted += 1
            self._on_accepted()
            threading.Thread(target=self._serve, args=(conn,), name="kv-side-conn", daemon=True).start()

    def _open(self, hello: bytes) -> tuple[_Transfer, int, bool] | None:
        """The transfer and stripe a connection's hello opens, and whether the client keeps the
        connection after it; None: refused."""
        token, stripe, count = hello[:TOKEN_BYTES], hello[TOKEN_BYTES], hello[TOKEN_BYTES + 1]
        keep, stripes = bool(count & KEEP_FLAG), count & ~KEEP_FLAG
        with self._lock:
            transfer = self._pending.get(token)
            if transfer is None or not 0 < stripes <= MAX_STRIPES or stripe >= stripes or stripe in transfer.opened \
                    or transfer.stripes not in (0, stripes) or (transfer.kind == _STREAM and stripes != 1):
                return None
            transfer.stripes = stripes
            transfer.opened.add(stripe)
            if len(transfer.opened) == stripes:
                del self._pending[token]  # every stripe is open: the token opens nothing more
        return transfer, stripe, keep

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._on_refused()
        log.warning("side channel: refused a connection: %s", why)

    def _serve(self, raw: socket.socket) -> None:
        """One connection: a transfer, then, when the client keeps it, the next ones."""
        conn: Connection = raw
        # One deadline for the TLS handshake and the token together, however the bytes trickle in.
        cut = threading.Timer(TOKEN_TIMEOUT_S, _cut, args=(raw,))
        cut.daemon = True
        cut.start()
        try:
            tune_socket(raw)
            raw.settimeout(TOKEN_TIMEOUT_S)
            if self._tls is not None:
                conn = TlsStream(raw, self._tls.server(), server_side=True)
            hello = bytearray(HELLO_BYTES)
            receive_exact(conn, memoryview(hello))
        except (OSError, ssl.SSLError, ValueError) as exc:
            raw.close()
            self._refuse(f"no valid hello within {TOKEN_TIMEOUT_S:g} s ({exc})")
            return
        finally:
            cut.cancel()
            self._handshakes.release()
        try:
            while self._transfer(conn, bytes(hello)):
                conn.settimeout(IDLE_TIMEOUT_S)  # idle: a kept connection holds no slot
                if not _next_hello(conn, hello):
                    return  # closed, or idle too long
        finally:
            raw.close()

    def _transfer(self, conn: Connection, hello: bytes) -> bool:
        """Move the stripe ``hello`` opens; whether the connection is kept for another."""
        if not self._slots.acquire(blocking=False):  # a token checked, but no room now: the client retries
            self._refuse("every transfer slot is busy")
            return False
        try:
            opened = self._open(hello)
            if opened is None:
                self._refuse("no valid token")
                return False
            return self._move(conn, *opened)
        finally:
            self._slots.release()

    def _move(self, conn: Connection, transfer: _Transfer, stripe: int, keep: bool) -> bool:
        try:
            conn.settimeout(self.timeout_s)
            if transfer.kind == _STREAM:
                assert transfer.serve is not None
                transfer.serve(conn)
                self._forget(transfer)
                transfer.finish(None)
                return False  # a stream's end is its connection's
            pieces = stripe_pieces([len(b) for b in transfer.buffers], stripe, transfer.stripes)
            if transfer.kind == _RECEIVE:
                parts = receive_pieces(conn, transfer.buffers, pieces)
                self._stripe_done(transfer, parts)
                if not transfer.over.wait(self.timeout_s) or transfer.results is None:
                    raise SideChannelError("another stripe of this transfer failed")
                conn.sendall(transfer.results)
            else:
                send_pieces(conn, transfer.buffers, pieces)
                self._stripe_done(transfer, [])
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._forget(transfer)
            transfer.finish(error=SideChannelError(f"side channel transfer failed: {exc}"))
            return False
        return keep

    def _stripe_done(self, transfer: _Transfer, parts: list[tuple[Piece, int]]) -> None:
        with self._lock:
            transfer.parts += parts
            transfer.finished += 1
            last = transfer.finished == transfer.stripes
        if not last:
            return
        self._forget(transfer)
        if transfer.kind == _RECEIVE:
            crcs = joined_crcs(len(transfer.buffers), transfer.parts)
            results = [crc == want for crc, want in zip(crcs, transfer.checksums)]
            transfer.results = bytes(results)
            transfer.finish(results)
        else:
            transfer.finish(None)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for transfer in pending:
            transfer.over.set()
            transfer.loop.call_soon_threadsafe(transfer.done.cancel)


# -- the client's side (blocking: run in a thread) ---------------------------------------------------
