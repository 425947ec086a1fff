"""A TCP side channel for KV payloads, under gRPC control calls.

gRPC over loopback moves a fifth of a memcpy here at best, bare grpcio's own ceiling; a plain
socket moves two to three times that. So the bytes of a transfer go over a socket of their own
while gRPC keeps the control: a reserve (or get) call over the authenticated gRPC channel
registers the transfer here and hands the caller a one-time token; the caller connects, sends
the token, then the payloads (or reads them); the commit call goes over gRPC again.

- **Authentication.** A connection must open with a token this server issued and has not seen
  used: anything else is closed at once, having written nothing anywhere. Tokens are 256 random
  bits, live until their transfer's reservation expires, and are handed out only by calls that
  passed mutual TLS and the role check (``access.py``), so holding one proves the same. With
  ``tls`` the socket is also wrapped in mutual TLS with the process's own certificate, for
  networks where the payloads must not be read on the way.
- **Receiving.** Payloads land straight in their destination (room reserved in the host pool),
  a slice at a time, each slice's CRC32 computed while it is still in cache; a payload whose CRC
  is not its header's is reported bad and never committed. The receiver answers one byte per
  payload (1 good, 0 bad) after the last.
- **Sending.** Payloads go out of the buffers they are in (``sendall`` of a memoryview).

Frames: ``token (32 bytes)`` then, for a receive, each payload's bytes in order (their sizes
are known to both sides from the control call) and back one result byte per payload; for a
send, each payload's bytes in order, back.

The server runs a thread per connection (blocking socket calls and the CRC release the GIL) and
reports each transfer's outcome to the asyncio loop that registered it.
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
from crescent.services.kvwire.fused_copy import SLICE_BYTES, crc32

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
SOCKET_BUFFER_BYTES = 8 << 20  # a few slices in flight: the sender never waits on the receiver's CRC
TOKEN_TIMEOUT_S = 5.0          # a connection that does not say who it is within this is closed
_RECEIVE, _SEND = "receive", "send"


class SideChannelError(ConnectionError):
    """A transfer that did not complete (refused, cut short, timed out)."""


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


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _receive_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        got = sock.recv_into(view[pos:], len(view) - pos)
        if got == 0:
            raise SideChannelError(f"the peer closed the side channel {len(view) - pos} bytes short")
        pos += got


def receive_checked(sock: socket.socket, into: memoryview) -> int:
    """Fill ``into`` from ``sock`` and return the CRC32 of the bytes, each slice checksummed
    as it lands (still in cache)."""
    into = into.cast("B") if into.format != "B" else into
    crc = 0
    for start in range(0, len(into), SLICE_BYTES):
        piece = into[start : start + SLICE_BYTES]
        _receive_exact(sock, piece)
        crc = crc32(piece, crc)
    return crc


@dataclass(eq=False)
class _Transfer:
    kind: str
    buffers: list[memoryview]
    checksums: list[int]             # receive: what each payload's CRC must be
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future = field(init=False)
    started: bool = False

    def __post_init__(self) -> None:
        self.done = self.loop.create_future()

    def finish(self, result: object = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.done.done():
                return
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(result)
        self.loop.call_soon_threadsafe(settle)


class SideChannelServer:
    """Listens for side-channel connections and moves the payloads of registered transfers."""

    def __init__(self, host: str, port: int = 0, *, server_tls: ssl.SSLContext | None = None,
                 timeout_s: float = 30.0, max_connections: int = 64,
                 on_refused: Callable[[], None] | None = None) -> None:
        self._tls = server_tls
        self.timeout_s = timeout_s
        self._on_refused = on_refused or (lambda: None)
        self._pending: dict[bytes, _Transfer] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-side-accept", daemon=True)
        self._acceptor.start()

    # -- registering transfers (on the event loop) ---------------------------------------------

    def _register(self, transfer: _Transfer) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._pending[token] = transfer
        return token

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

    def withdraw(self, token: bytes) -> bool:
        """Forget a transfer nobody opened; False when it has started (its buffers are in use
        until its future is done)."""
        with self._lock:
            transfer = self._pending.pop(token, None)
        if transfer is None:
            return False
        transfer.done.cancel()
        return True

    # -- the connections (threads) --------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: the client falls back to another mover this time
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-side-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        transfer: _Transfer | None = None
        try:
            _tune(conn)
            conn.settimeout(TOKEN_TIMEOUT_S)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            token = bytearray(TOKEN_BYTES)
            _receive_exact(conn, memoryview(token))
            with self._lock:
                transfer = self._pending.pop(bytes(token), None)
            if transfer is None:
                self._on_refused()
                log.warning("side channel: refused a connection without a valid token")
                return
            transfer.started = True
            conn.settimeout(self.timeout_s)
            if transfer.kind == _RECEIVE:
                results = [receive_checked(conn, buf) == crc for buf, crc in zip(transfer.buffers, transfer.checksums)]
                conn.sendall(bytes(results))
                transfer.finish(results)
            else:
                for buf in transfer.buffers:
                    conn.sendall(buf)
                transfer.finish(None)
        except (OSError, ssl.SSLError, ValueError) as exc:
            if transfer is not None:
                transfer.finish(error=SideChannelError(f"side channel transfer failed: {exc}"))
            else:
                self._on_refused()
                log.warning("side channel: dropped a connection before its token: %s", exc)
        finally:
            try:
                conn.close()
            finally:
                self._slots.release()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for transfer in pending:
            transfer.loop.call_soon_threadsafe(transfer.done.cancel)


# -- the client's side (blocking: run in a thread) ---------------------------------------------------

def _connect(address: str, token: bytes, timeout_s: float, client_tls: ssl.SSLContext | None,
             server_name: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    try:
        _tune(sock)
        if client_tls is not None:
            sock = client_tls.wrap_socket(sock, server_hostname=server_name or host.strip("[]"))
        sock.sendall(token)
    except BaseException:
        sock.close()
        raise
    return sock


def send_payloads(address: str, token: bytes, payloads: Sequence[bytes | memoryview], *, timeout_s: float = 30.0,
                  client_tls: ssl.SSLContext | None = None, server_name: str = "") -> list[bool]:
    """Send ``payloads`` into a receive the server registered under ``token``; whether each
    landed with the right CRC."""
    with _connect(address, token, timeout_s, client_tls, server_name) as sock:
        for payload in payloads:
            sock.sendall(payload)
        answer = bytearray(len(payloads))
        _receive_exact(sock, memoryview(answer))
    return [b == 1 for b in answer]


def receive_payloads(address: str, token: bytes, into: Sequence[memoryview], *, timeout_s: float = 30.0,
                     client_tls: ssl.SSLContext | None = None, server_name: str = "") -> list[int]:
    """Receive a send the server registered under ``token`` into ``into``; each payload's CRC32,
    computed as it landed."""
    with _connect(address, token, timeout_s, client_tls, server_name) as sock:
        return [receive_checked(sock, buf) for buf in into]
