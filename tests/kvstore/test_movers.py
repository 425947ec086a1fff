"""The byte movers under the reserve/commit control calls, against real nodes on loopback.

What a user would notice: blocks put and got over the TCP side channel are the blocks sent;
bytes damaged on the side channel are refused as they land and never stored; a connection that
does not open with a token the node issued writes nothing; a client whose optional engine
(NIXL) is absent or broken, or whose node lacks a mover, still stores and reads everything the
portable way; and the mover in use with each node shows in the client's metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import os
import socket
import sys
import types
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from crescent.protos import kvstore_pb2
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.movers import nixl as nixl_mover
from crescent.services.kvwire.fused_copy import crc32
from crescent.services.kvwire.nixl_engine import API_MODULES
from crescent.services.kvwire import side_channel, side_channel_client
from crescent.services.kvwire.side_channel import SideChannelServer, joined_crcs, stripe_pieces
from crescent.services.kvwire.side_channel_client import send_payloads

from .helpers import MODEL, make_chain

MIB = 1 << 20


def selected(address: str, mover: str) -> float | None:
    return REGISTRY.get_sample_value("crescent_kv_mover_selected", {"peer": address, "mover": mover})


def _nixl_installed() -> bool:
    """Whether a NIXL package is installed, found without importing it: loaded into the test
    process, NIXL 1.5.1's native libraries make grpc_tools' protoc crash it later (a segfault in
    tests/test_protos.py), so the real agent runs in a process of its own (``NIXL_CLIENT``)."""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in API_MODULES)


# A NIXL client in its own process: three blocks put one-sided, the last damaged on the way.
NIXL_CLIENT = """
import asyncio, dataclasses, hashlib, json, sys
from crescent.services.kvstore.client import KvStoreClient
from tests.kvstore.helpers import make_chain

async def main():
    client = KvStoreClient(sys.argv[1], movers=["nixl"])
    chain = make_chain(3, floats=int(sys.argv[2]))
    damaged = bytearray(chain[2].payload)
    damaged[-1] ^= 1
    result = await client.put([*chain[:2], dataclasses.replace(chain[2], payload=bytes(damaged))])
    print(json.dumps({"stored": result.stored, "rejected": result.rejected, "mover": client.mover,
                      "keys": [b.key.hex() for b in chain],
                      "sha256": [hashlib.sha256(b.payload).hexdigest() for b in chain]}))
    await client.close()

asyncio.run(main())
"""


@pytest.mark.slow
async def test_the_side_channel_moves_blocks_both_ways_and_across_several_calls(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, movers=["tcp"])
    try:
        chains = [make_chain(3, floats=MIB, salt=bytes([i])) for i in range(3)]  # 4 MiB blocks
        for chain in chains:
            assert (await client.put(chain)).stored == 3
        for chain in chains:
            got = await client.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "tcp" and not client.errors
        assert selected(node.address, "tcp") == 1 and selected(node.address, "grpc") == 0
        assert node.metric("crescent_kvstore_transferred_bytes_total", direction="in") == 9 * 4 * MIB
    finally:
        await client.close()


@pytest.mark.parametrize("floats, where", [(MIB // 4, 12345), (3 * MIB, -7)])  # one connection; two stripes
@pytest.mark.slow
async def test_bytes_damaged_on_the_side_channel_are_refused_as_they_land(kvstore_node, floats: int, where: int) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, movers=["tcp"])
    reader = KvStoreClient(node.address, movers=["grpc"])
    try:
        good, victim = make_chain(2, floats=floats)
        damaged = bytearray(victim.payload)
        damaged[where] ^= 0x40  # one bit flipped after the header's CRC was computed
        sent = dataclasses.replace(victim, payload=bytes(damaged))
        result = await client.put([good, sent])
        assert (result.stored, result.rejected) == (1, 1)
        assert client.errors["integrity"] == 1  # the node said which payload arrived bad
        assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1
        assert await reader.exists([good.key, victim.key]) == [True, False]
        assert (await client.put([victim])).stored == 1  # the intact one is taken
        got = await reader.get([victim.key], MODEL)
        assert bytes(got[victim.key].payload) == bytes(victim.payload)
        stat = await reader.stat()
        assert stat is not None and stat.tiers[0].reserved_bytes == 0  # the refused room went back
    finally:
        await client.close()
        await reader.close()


def _side_address(reply) -> tuple[str, int]:  # noqa: ANN001 - a ShmReserveReply
    host, _, port = reply.side_address.rpartition(":")
    return host, int(port)


def _closed_without_answer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.slow
async def test_a_connection_without_the_issued_token_writes_nothing(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    client = KvStoreClient(node.address, movers=["tcp"])
    reader = KvStoreClient(node.address, movers=["grpc"])
    try:
        block = make_chain(1, floats=MIB // 4)[0]
        reply = await client._stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=[block.to_meta()], mover="tcp"))
        assert reply.slots[0].granted and len(reply.side_token) == 32
        # Someone who reached the port but holds no token (or a guessed one) sends the payload.
        with socket.create_connection(_side_address(reply)) as sock:
            sock.sendall(os.urandom(32) + bytes(block.payload))
            assert _closed_without_answer(sock)
        committed = await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(reservation=reply.reservation,
                                                                              written=[True]))
        assert (committed.stored, committed.rejected) == (0, 1), "nothing landed, so nothing is stored"
        assert await reader.exists([block.key]) == [False]
        # A token works once: replaying one that opened a transfer is refused too.
        assert (await client.put([block])).stored == 1
        with socket.create_connection(_side_address(reply)) as sock:
            sock.sendall(reply.side_token + bytes([0, 1]) + bytes(block.payload))  # stripe 0 of 1, as a client says
            assert _closed_without_answer(sock)
        assert node.metric("crescent_kvstore_side_channel_refused_total") == 2
    finally:
        await client.close()
        await reader.close()


def hide_nixl(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """As if no NIXL package were installed: in this process, and in the processes started after
    (packages of those names first on their path, each failing to import as an absent one does)."""
    packages = {name.split(".")[0] for name in API_MODULES}
    for name in packages | set(API_MODULES):
        monkeypatch.setitem(sys.modules, name, None)
    for name in packages:
        (tmp_path / "no-nixl" / name).mkdir(parents=True)
        (tmp_path / "no-nixl" / name / "__init__.py").write_text(f"raise ModuleNotFoundError('hidden', name={name!r})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "no-nixl"), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow
async def test_without_nixl_here_the_client_falls_back_to_the_portable_mover(kvstore_node, monkeypatch, tmp_path) -> None:
    hide_nixl(monkeypatch, tmp_path)
    node = kvstore_node({"nixl": True})  # asked for, but NIXL is not installed there: the node serves the rest
    client = KvStoreClient(node.address, movers=["nixl"])
    try:
        assert not client.movers[0].usable, "an absent engine is given up at once"
        chain = make_chain(2, floats=MIB // 4)
        assert (await client.put(chain)).stored == 2
        got = await client.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "grpc" and not client.errors
        assert selected(node.address, "grpc") == 1 and selected(node.address, "nixl") == 0
    finally:
        await client.close()
    assert "NIXL cannot start here" in node.log.read_text()

    # A broken install (the package imports, its agent fails) is given up the same way.
    broken = types.ModuleType("nixl._api")
    broken.nixl_agent_config = lambda **kw: None

    def no_agent(*args, **kwargs):
        raise OSError("libucp.so.0: cannot open shared object file")

    broken.nixl_agent = no_agent
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", broken)
    client = KvStoreClient(node.address, movers=["nixl", "tcp"])
    try:
        assert (await client.put(make_chain(1, salt=b"b"))).stored == 1
        assert client.mover == "tcp"
    finally:
        await client.close()


@pytest.mark.skipif(not _nixl_installed(), reason="NIXL is not installed here (pip install 'crescent[nixl]')")
@pytest.mark.slow
async def test_with_nixl_blocks_are_written_one_sided_and_checked_at_commit(kvstore_node) -> None:
    node = kvstore_node({"nixl": True, "tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", NIXL_CLIENT, node.address, str(MIB // 4), cwd=Path(__file__).parents[2],
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(writer.communicate(), 120)
    assert writer.returncode == 0, err.decode()[-2000:]
    put = json.loads(out.decode().splitlines()[-1])
    assert (put["stored"], put["rejected"], put["mover"]) == (2, 1, "nixl")
    assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1  # verified at commit
    reader = KvStoreClient(node.address, movers=["grpc"])
    try:
        got = await reader.get_prefix([bytes.fromhex(k) for k in put["keys"]], MODEL)
        assert [hashlib.sha256(b.payload).hexdigest() for b in got] == put["sha256"][:2]
    finally:
        await reader.close()


class _WorkingEngine:
    """An engine that starts: the node is what lacks NIXL in this case."""

    def __init__(self, role: str) -> None:
        self.role = role


@pytest.mark.slow
async def test_a_node_without_a_mover_is_served_the_next_way_and_the_choice_is_per_node(kvstore_node, monkeypatch) -> None:
    monkeypatch.setattr(nixl_mover, "NixlEngine", _WorkingEngine)
    plain = kvstore_node({"side_channel": {"enabled": False}}, name="plain")
    side = kvstore_node(name="side")
    clients = [KvStoreClient(n.address, movers=["nixl", "tcp", "grpc"]) for n in (plain, side)]
    try:
        for client in clients:
            chain = make_chain(2, floats=MIB // 4, salt=client.address.encode())
            assert (await client.put(chain)).stored == 2
            got = await client.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert [c.mover for c in clients] == ["grpc", "tcp"]
        assert [[m.usable for m in c.movers] for c in clients] == [[False, False, True], [False, True, True]]
        assert selected(plain.address, "grpc") == 1 and selected(side.address, "tcp") == 1
        assert selected(side.address, "grpc") == 0 and selected(plain.address, "tcp") == 0
        assert not any(c.errors for c in clients)
    finally:
        for client in clients:
            await client.close()


@pytest.mark.slow
async def test_a_side_channel_this_client_cannot_reach_costs_one_fallback_not_one_per_call(kvstore_node) -> None:
    # The node advertises an address nothing answers on (as behind a firewall or network policy).
    node = kvstore_node({"side_channel": {"advertise_host": "127.0.0.2"}})
    client = KvStoreClient(node.address)  # the default movers: tcp, then grpc
    try:
        for salt in (b"1", b"2"):
            chain = make_chain(2, floats=MIB // 4, salt=salt)
            assert (await client.put(chain)).stored == 2  # the first call falls back within itself
            got = await client.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "grpc" and not client.movers[0].usable
        assert client.errors["put_tcp"] == 1 and client.errors["get_tcp"] == 0, "given up after one try"
        stat = await client.stat()
        assert stat is not None and stat.tiers[0].reserved_bytes == 0  # the room reserved for it went back
    finally:
        await client.close()


@pytest.mark.slow
async def test_peer_nodes_fetch_from_each_other_over_the_side_channel(kvstore_node) -> None:
    a = kvstore_node(name="node-a")
    b = kvstore_node({"peers": {"node-a": a.address}}, name="node-b")
    ca, cb = KvStoreClient(a.address, movers=["grpc"]), KvStoreClient(b.address, movers=["grpc"])
    try:
        chain = make_chain(3, floats=MIB // 4)
        assert (await ca.put(chain)).stored == 3
        got = await cb.get_prefix([x.key for x in chain], MODEL)  # node-b asks node-a
        assert [bytes(x.payload) for x in got] == [bytes(x.payload) for x in chain]
        # (labels in /metrics order: alphabetical)
        assert b.metric("crescent_kv_mover_selected", mover="tcp", peer=a.address) == 1
        assert b.metric("crescent_kv_mover_bytes_total", direction="get", mover="tcp", peer=a.address) == 3 * MIB
    finally:
        await ca.close()
        await cb.close()


def test_an_unknown_mover_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown kvstore mover.*rdma.*valid: cuda_ipc, shm, tcp, nixl, grpc"):
        KvStoreClient("127.0.0.1:1", movers=["rdma"])


@pytest.mark.parametrize("sizes, stripes", [([5 * MIB, 7 * MIB], 2), ([1, 0, 3 * MIB, 12345], 3), ([MIB], 1)])
def test_stripes_cover_every_byte_once_and_their_crcs_join(sizes: list[int], stripes: int) -> None:
    payloads = [os.urandom(n) for n in sizes]
    parts, covered = [], [bytearray(n) for n in sizes]
    for stripe in range(stripes):
        for i, a, b in stripe_pieces(sizes, stripe, stripes):
            covered[i][a:b] = payloads[i][a:b]
            parts.append(((i, a, b), crc32(payloads[i][a:b])))
    assert [bytes(c) for c in covered] == payloads
    assert sum(b - a for (_, a, b), _ in parts) == sum(sizes)
    assert joined_crcs(len(sizes), parts[::-1]) == [crc32(p) for p in payloads]


async def test_a_stripe_arriving_after_its_transfer_failed_writes_nothing() -> None:
    """Once a transfer has ended, its room may hold another block: a late stripe is refused."""
    refused = []
    server = SideChannelServer("127.0.0.1", on_refused=lambda: refused.append(1))
    room = bytearray(16 * MIB)
    try:
        token, landed = server.expect_receive([memoryview(room)], [0])
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(token + bytes([0, 2]) + b"x" * 1000)  # stripe 0 of 2, cut short
        with pytest.raises(ConnectionError):
            await landed
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(token + bytes([1, 2]) + b"y" * MIB)  # stripe 1 arrives late
            assert _closed_without_answer(sock)
        assert refused == [1]
        assert b"y" not in room  # nothing written by the late stripe
    finally:
        server.close()


@pytest.mark.slow
async def test_calls_in_a_row_share_one_kept_connection_each_way(kvstore_node) -> None:
    """No connect (nor TLS handshake) per call: the client keeps its connection for the next one."""
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, movers=["tcp"])
    try:
        chains = [make_chain(2, floats=MIB // 4, salt=bytes([i])) for i in range(4)]  # 2 MiB a put: one stripe
        for chain in chains:
            assert (await client.put(chain)).stored == 2
            got = await client.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.mover == "tcp" and not client.errors
        assert node.metric("crescent_kvstore_side_channel_connections_total") == 2  # one to put, one to get
    finally:
        await client.close()


async def test_a_kept_connection_the_node_dropped_is_replaced_and_nothing_lands_twice(monkeypatch) -> None:
    monkeypatch.setattr(side_channel, "IDLE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(side_channel_client, "_peer_closed", lambda raw: False)  # as if the close crossed our reuse
    server = SideChannelServer("127.0.0.1")
    address = f"127.0.0.1:{server.port}"

    async def put(data: bytes) -> tuple[list[bool], bytes]:
        room = bytearray(len(data))
        token, landed = server.expect_receive([memoryview(room)], [crc32(data)])
        answers = await asyncio.to_thread(send_payloads, address, token, [data], timeout_s=10)
        return answers, bytes(room) if await landed == [True] else b""

    try:
        first, second, third = (os.urandom(MIB) for _ in range(3))
        assert await put(first) == ([True], first)
        await asyncio.sleep(0.6)  # the node closes the idle connection
        assert await put(second) == ([True], second)  # the dead one failed; a fresh one carried it
        assert await put(third) == ([True], third)  # and was kept
        assert server.accepted == 2
        # A client that does not ask to keep its connection (no KEEP_FLAG) sees it closed after.
        room = bytearray(1000)
        token, landed = server.expect_receive([memoryview(room)], [crc32(b"z" * 1000)])
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(token + bytes([0, 1]) + b"z" * 1000)
            sock.settimeout(5)
            assert sock.recv(1) == b"\x01" and _closed_without_answer(sock)
        assert await landed == [True]
    finally:
        side_channel_client.close_kept_connections()
        server.close()
