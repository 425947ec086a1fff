"""The client's half of the TCP side channel (``side_channel.py`` has the protocol and the server):
dial a node's side channel, open a transfer's stripes with the token a control call handed out,
send or receive the payloads, and keep connections for the next transfer (``KEEP_FLAG``).
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from crescent.services.kvwire.side_channel import (
    CLIENT_IDLE_S,
    CONNECT_TIMEOUT_S,
    KEEP_FLAG,
    MAX_IDLE_PER_PEER,
    Connection,
    Piece,
    SideChannelUnreachable,
    joined_crcs,
    receive_exact,
    receive_pieces,
    send_pieces,
    stripe_pieces,
    stripes_for,
    tune_socket,
)
from crescent.services.kvwire.tls_stream import TlsStream

PeerKey = tuple[str, int, str, bool]  # address, id of the TLS context (0: none), server name, receiving


class _KeptConnections:
    """Connections a client keeps between transfers, per node and direction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[PeerKey, list[tuple[Connection, socket.socket, float]]] = {}

    def take(self, key: PeerKey) -> tuple[Connection, socket.socket] | None:
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                conn, raw, since = idle.pop()
            if time.monotonic() - since < CLIENT_IDLE_S and not _peer_closed(raw):
                return conn, raw
            conn.close()

    def give(self, key: PeerKey, conn: Connection, raw: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE_PER_PEER:
                idle.append((conn, raw, time.monotonic()))
                return
        conn.close()

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for entries in idle.values():
            for conn, _, _ in entries:
                conn.close()


_KEPT = _KeptConnections()


def close_kept_connections() -> None:
    """Close every connection this process keeps for later transfers (a client shutting down)."""
    _KEPT.close_all()


def _peer_closed(raw: socket.socket) -> bool:
    """An idle connection with something to read: the node closed it (or broke the protocol)."""
    try:
        return bool(select.select([raw], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def connect_to(address: str, timeout_s: float, client_tls: ssl.SSLContext | None, server_name: str,
             receiving: bool) -> tuple[Connection, socket.socket]:
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=min(CONNECT_TIMEOUT_S, timeout_s))
    except OSError as exc:
        raise SideChannelUnreachable(f"cannot connect to the side channel at {address}: {exc!r}") from exc
    conn: Connection = sock
    try:
        sock.settimeout(timeout_s)
        tune_socket(sock)
        if client_tls is not None:
            name = server_name or host.strip("[]")
            conn = (TlsStream(sock, client_tls, server_side=False, server_hostname=name) if receiving
                    else client_tls.wrap_socket(sock, server_hostname=name))  # a sender: fewer copies
    except BaseException:
        sock.close()
        raise
    # wrap_socket detaches ``sock``: an SSLSocket is then the socket to watch; a TlsStream is not one
    return conn, conn if isinstance(conn, socket.socket) else sock


UNSPECIFIED_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def dial_target(side_address: str, grpc_address: str, client_tls: ssl.SSLContext | None
                ) -> tuple[str, ssl.SSLContext | None]:
    """Where to connect for a side channel a server advertised as ``side_address`` (``tls://``
    first: mutual TLS), and with which TLS context: an unspecified host (it listens on every
    interface) becomes the host we dial it at for gRPC (``grpc_address``). ``ssl.SSLError``
    when it asks for TLS and this client has no certificate."""
    wants_tls = side_address.startswith("tls://")
    host, _, port = side_address.removeprefix("tls://").rpartition(":")
    if host in UNSPECIFIED_HOSTS:
        host = grpc_address.rpartition(":")[0]
    if wants_tls and client_tls is None:
        raise ssl.SSLError("the side channel asks for TLS and this client has no certificate")
    return f"{host}:{port}", client_tls if wants_tls else None


def _striped(address: str, token: bytes, sizes: list[int], work, timeout_s: float,  # noqa: ANN001
             client_tls: ssl.SSLContext | None, server_name: str, receiving: bool) -> list:
    """Run ``work(sock, pieces)`` on each stripe's connection at once; their results in order."""
    stripes = stripes_for(sum(sizes))
    key: PeerKey = (address, id(client_tls) if client_tls is not None else 0, server_name, receiving)

    def one(stripe: int):  # noqa: ANN202
        hello = token + bytes([stripe, stripes | KEEP_FLAG])
        pieces = stripe_pieces(sizes, stripe, stripes)
        taken = _KEPT.take(key)
        if taken is not None:
            kept, kept_raw = taken
            try:
                kept.settimeout(timeout_s)
                kept.sendall(hello)
                result = work(kept, pieces)
            except (OSError, ssl.SSLError):
                # Closed by the node while idle: it never read this hello, so a fresh connection
                # may open the stripe. Had it read it, the stripe is open and the retry is refused.
                kept.close()
            else:
                _KEPT.give(key, kept, kept_raw)
                return result
        conn, raw = connect_to(address, timeout_s, client_tls, server_name, receiving)
        try:
            conn.sendall(hello)
            result = work(conn, pieces)
        except BaseException:
            conn.close()
            raise
        _KEPT.give(key, conn, raw)
        return result

    if stripes == 1:
        return [one(0)]
    with ThreadPoolExecutor(stripes - 1, thread_name_prefix="kv-side-stripe") as pool:
        others = [pool.submit(one, s) for s in range(1, stripes)]
        first = one(0)
        return [first, *(f.result() for f in others)]


def send_payloads(address: str, token: bytes, payloads: Sequence[bytes | memoryview], *, timeout_s: float = 30.0,
                  client_tls: ssl.SSLContext | None = None, server_name: str = "") -> list[bool]:
    """Send ``payloads`` into a receive the server registered under ``token``; whether each
    landed with the right CRC."""
    def work(sock: Connection, pieces: list[Piece]) -> bytes:
        send_pieces(sock, payloads, pieces)
        answer = bytearray(len(payloads))
        receive_exact(sock, memoryview(answer))
        return bytes(answer)

    answers = _striped(address, token, [len(p) for p in payloads], work, timeout_s, client_tls, server_name,
                       receiving=False)
    return [b == 1 for b in answers[0]]


def receive_payloads(address: str, token: bytes, into: Sequence[memoryview], *, timeout_s: float = 30.0,
                     client_tls: ssl.SSLContext | None = None, server_name: str = "") -> list[int]:
    """Receive a send the server registered under ``token`` into ``into``; each payload's CRC32,
    computed as it landed."""
    def work(sock: Connection, pieces: list[Piece]) -> list[tuple[Piece, int]]:
        return receive_pieces(sock, into, pieces)

    stripes = _striped(address, token, [len(b) for b in into], work, timeout_s, client_tls, server_name,
                       receiving=True)
    return joined_crcs(len(into), [part for parts in stripes for part in parts])
