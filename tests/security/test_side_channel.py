"""The kvstore's TCP side channel is no open door (a real node with mutual TLS, on loopback).

Its transfers are opened by one-time tokens that only the authenticated, role-checked reserve
and get calls hand out; with TLS configured the socket itself also runs mutual TLS with the
platform's certificates. What an attacker who reaches the port would notice: a plaintext
connection, even with a valid token, or a certificate from another CA, is closed and writes
nothing; a role that may not write blocks gets no token at all.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import pytest

from crescent.protos import kvstore_pb2
from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.side_channel import tls_contexts
from tests.kvstore.conftest import Node, start_node
from tests.kvstore.helpers import MODEL, make_chain
from tests.security.support import Pki, make_test_pki

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

MIB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def kvstore(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = start_node({"tls": pki.server["kvstore"], "node_id": "kvstore-0"}, tmp_path_factory.mktemp("kv"), "kvstore-0")
    yield node
    node.stop()


def _host_port(side_address: str) -> tuple[str, int]:
    assert side_address.startswith("tls://"), "a node with TLS runs its side channel with TLS too"
    host, _, port = side_address.removeprefix("tls://").rpartition(":")
    return host, int(port)


def _refused(connect) -> bool:  # noqa: ANN001 - returns a connected socket or raises
    try:
        with connect() as sock:
            sock.settimeout(5)
            return sock.recv(1) == b""
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return True


async def test_engines_move_blocks_over_the_side_channel_with_mutual_tls(kvstore: Node, pki: Pki) -> None:
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=pki.by_role["prefill"])
    try:
        chain = make_chain(2, floats=MIB // 4, salt=b"tls")
        assert (await client.put(chain)).stored == 2
        got = await client.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "tcp" and not client.errors
    finally:
        await client.close()


async def test_mutual_tls_is_shaken_hands_once_per_kept_connection_not_per_call(kvstore: Node, pki: Pki) -> None:
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=pki.by_role["prefill"])
    before = kvstore.metric("crescent_kvstore_side_channel_connections_total")
    try:
        for i in range(3):
            chain = make_chain(2, floats=MIB // 4, salt=b"tls-kept" + bytes([i]))
            assert (await client.put(chain)).stored == 2
            got = await client.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "tcp" and not client.errors
        assert kvstore.metric("crescent_kvstore_side_channel_connections_total") - before == 2
    finally:
        await client.close()


async def test_striped_transfers_over_mutual_tls_arrive_whole(kvstore: Node, pki: Pki) -> None:
    """12 MiB goes over two TLS connections at once; the node reads them through memory BIOs."""
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=pki.by_role["prefill"])
    try:
        block = make_chain(1, floats=3 * MIB, salt=b"tls-striped")[0]
        assert (await client.put([block])).stored == 1
        got = await client.get([block.key], MODEL)
        assert bytes(got[block.key].payload) == bytes(block.payload)
        assert client.mover == "tcp" and not client.errors
        await client.remove([block.key])
    finally:
        await client.close()


async def test_a_tls_stripe_cut_short_stores_nothing(kvstore: Node, pki: Pki) -> None:
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=pki.by_role["prefill"])
    try:
        block = make_chain(1, floats=MIB // 4, salt=b"tls-short")[0]
        reply = await client._stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=[block.to_meta()], mover="tcp"))
        context = tls_contexts(pki.by_role["prefill"])[1]
        with context.wrap_socket(socket.create_connection(_host_port(reply.side_address)),
                                 server_hostname="localhost") as sock:
            sock.sendall(reply.side_token + bytes([0, 1]) + bytes(block.payload)[: MIB // 2])  # then it drops
        committed = await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(reservation=reply.reservation,
                                                                              written=[True]))
        assert (committed.stored, committed.rejected) == (0, 1)
        assert await client.exists([block.key]) == [False]
    finally:
        await client.close()


async def test_a_valid_token_over_plaintext_or_another_ca_writes_nothing(kvstore: Node, pki: Pki) -> None:
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=pki.by_role["prefill"])
    try:
        for attempt in ("plaintext", "other CA"):
            block = make_chain(1, floats=MIB // 4, salt=attempt.encode())[0]
            reply = await client._stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=[block.to_meta()], mover="tcp"))
            address = _host_port(reply.side_address)
            payload = reply.side_token + bytes(block.payload)
            if attempt == "plaintext":
                def connect(address=address, payload=payload) -> socket.socket:
                    sock = socket.create_connection(address)
                    sock.sendall(payload)
                    return sock
            else:
                stranger = tls_contexts(pki.other_ca)[1]

                def connect(address=address, payload=payload, stranger=stranger) -> socket.socket:
                    sock = stranger.wrap_socket(socket.create_connection(address), server_hostname="localhost")
                    sock.sendall(payload)
                    return sock
            assert _refused(connect), attempt
            committed = await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(
                reservation=reply.reservation, written=[True]))
            assert (committed.stored, committed.rejected) == (0, 1), attempt
            assert await client.exists([block.key]) == [False], attempt
    finally:
        await client.close()


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
async def test_a_role_that_may_not_write_blocks_gets_no_token(kvstore: Node, pki: Pki, role: str) -> None:
    tls: PeerTls = pki.by_role[role]
    client = KvStoreClient(kvstore.address, movers=["tcp"], tls=tls)
    try:
        block = make_chain(1, salt=role.encode())[0]
        result = await client.put([block])
        assert result.stored == 0
        assert not client.movers[0].usable, "refused by the role check: the side channel is given up"
    finally:
        await client.close()
