"""Striped side-channel transfers against a real node on loopback, driven stripe by stripe.

What a user would notice: a put whose stripes connect in any order stores the very bytes sent;
a put with one stripe cut short stores nothing, answers no stripe, and gives its room back.
"""

from __future__ import annotations

import socket

import pytest

from crescent.protos import kvstore_pb2
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.side_channel import stripe_pieces

from .helpers import MODEL, make_chain

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

MIB = 1 << 20


def _stripe_bytes(payload: bytes, stripe: int, stripes: int) -> bytes:
    return b"".join(payload[a:b] for _, a, b in stripe_pieces([len(payload)], stripe, stripes))


async def _reserve(client: KvStoreClient, block) -> kvstore_pb2.ShmReserveReply:  # noqa: ANN001 - a KvBlock
    reply = await client._stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=[block.to_meta()], mover="tcp"))
    assert reply.slots[0].granted
    return reply


def _open(reply: kvstore_pb2.ShmReserveReply, stripe: int, stripes: int) -> socket.socket:
    host, _, port = reply.side_address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(reply.side_token + bytes([stripe, stripes]))
    return sock


def _answer(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


async def test_stripes_connecting_out_of_order_store_the_bytes_sent(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, movers=["grpc"])
    try:
        block = make_chain(1, floats=3 * MIB)[0]  # 12 MiB: three stripes of 4 MiB
        payload = bytes(block.payload)
        reply = await _reserve(client, block)
        socks = [_open(reply, stripe, 3) for stripe in (2, 0, 1)]  # the last stripe first
        for sock, stripe in zip(socks, (2, 0, 1)):
            sock.sendall(_stripe_bytes(payload, stripe, 3))
        assert [_answer(s) for s in socks] == [b"\x01"] * 3  # every stripe hears: arrived whole
        for sock in socks:
            sock.close()
        committed = await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(reservation=reply.reservation,
                                                                              written=[True]))
        assert (committed.stored, committed.rejected) == (1, 0)
        got = await client.get([block.key], MODEL)
        assert bytes(got[block.key].payload) == payload
    finally:
        await client.close()


async def test_a_stripe_cut_short_fails_the_whole_put_and_nothing_is_stored(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, movers=["grpc"])
    try:
        block = make_chain(1, floats=3 * MIB)[0]
        payload = bytes(block.payload)
        reply = await _reserve(client, block)
        whole, short = _open(reply, 0, 2), _open(reply, 1, 2)
        whole.sendall(_stripe_bytes(payload, 0, 2))
        short.sendall(_stripe_bytes(payload, 1, 2)[: MIB])  # then the connection drops
        short.close()
        assert _answer(whole) == b"", "the whole stripe is not told its bytes were taken"
        whole.close()
        committed = await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(reservation=reply.reservation,
                                                                              written=[True]))
        assert (committed.stored, committed.rejected) == (0, 1)
        assert await client.exists([block.key]) == [False]
        stat = await client.stat()
        assert stat is not None and stat.tiers[0].reserved_bytes == 0  # the room went back
        # The same block through the client's own striped put is taken whole.
        sender = KvStoreClient(node.address, movers=["tcp"])
        try:
            assert (await sender.put([block])).stored == 1
        finally:
            await sender.close()
        assert bytes((await client.get([block.key], MODEL))[block.key].payload) == payload
    finally:
        await client.close()
