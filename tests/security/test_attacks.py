"""The two attacks of issue 11, scripted against real scheduler and kvstore processes running
mutual TLS as ``crescent up`` runs them.

1. Slot hijack: a local process registers as ``prefill-0`` at its own address, so the next
   placement (with the user's prompt and cache salt) reaches it. Without an engine certificate
   naming prefill-0 every attempt fails and the registry keeps the real instance.
2. Cache poisoning and reading: a non-engine removes blocks and puts forged ones with valid
   checksums, or lists and reads every tenant's prompt tokens. All refused; the blocks stay.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from crescent.protos import common_pb2, kvstore_pb2, kvstore_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.common.grpc_service import open_channel
from crescent.services.kvstore.client import KvStoreClient
from tests.kvstore.conftest import Node, start_node
from tests.kvstore.helpers import MODEL, make_chain
from tests.scheduler.support import SchedulerProcess, free_port, instance
from tests.security.support import Pki, make_test_pki

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

LEGIT_ADDRESS = "127.0.0.1:7001"
ROGUE_ADDRESS = "127.0.0.1:6666"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_test_pki(tmp_path_factory.mktemp("attack-pki"))


@pytest.fixture(scope="module")
def scheduler(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    port, admin = free_port(), free_port()
    config = tmp_path_factory.mktemp("scheduler") / "scheduler.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port, "admin_port": admin},
                                      "tls": pki.server["scheduler"]}))
    process = SchedulerProcess(config, port, admin)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def kvstore(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = start_node({"tls": pki.server["kvstore"], "node_id": "kvstore-0"}, tmp_path_factory.mktemp("kv"), "kvstore-0")
    yield node
    node.stop()


def _register(scheduler: SchedulerProcess, tls, info: scheduler_pb2.InstanceInfo) -> grpc.StatusCode:
    async def go() -> grpc.StatusCode:
        async with open_channel(scheduler.address, tls) as channel:
            try:
                await scheduler_pb2_grpc.SchedulerStub(channel).Register(info, timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK
    return go()


async def _instances(scheduler: SchedulerProcess, pki: Pki) -> dict[str, str]:
    async with open_channel(scheduler.address, pki.by_role["admin"]) as channel:
        reply = await scheduler_pb2_grpc.SchedulerStub(channel).ListInstances(scheduler_pb2.ListInstancesRequest(),
                                                                              timeout=5)
    return {s.info.instance_id: s.info.address for s in reply.instances}


async def test_a_rogue_register_as_prefill_0_fails_without_its_engine_certificate(scheduler, pki: Pki) -> None:
    legit = instance("prefill-0", "prefill")
    legit.address = LEGIT_ADDRESS
    assert await _register(scheduler, pki.by_role["prefill"], legit) == grpc.StatusCode.OK

    rogue = instance("prefill-0", "prefill")
    rogue.address = ROGUE_ADDRESS
    attempts = {
        "plaintext": (None, grpc.StatusCode.UNAVAILABLE),
        "no client certificate": (pki.no_client_cert(), grpc.StatusCode.UNAVAILABLE),
        "another CA's admin": (pki.other_ca, grpc.StatusCode.UNAVAILABLE),
        "certificate without a role": (pki.roleless, grpc.StatusCode.UNAUTHENTICATED),
        "the gateway's": (pki.by_role["gateway"], grpc.StatusCode.PERMISSION_DENIED),
        "the admin's": (pki.by_role["admin"], grpc.StatusCode.PERMISSION_DENIED),
        "decode-0's": (pki.by_role["decode"], grpc.StatusCode.PERMISSION_DENIED),
        "kvstore-0's": (pki.by_role["kvstore"], grpc.StatusCode.PERMISSION_DENIED),
    }
    outcomes = {who: await _register(scheduler, tls, rogue) for who, (tls, _) in attempts.items()}
    assert outcomes == {who: code for who, (_, code) in attempts.items()}
    assert (await _instances(scheduler, pki))["prefill-0"] == LEGIT_ADDRESS
    assert ROGUE_ADDRESS not in scheduler.metrics()


async def _status(coro) -> grpc.StatusCode:
    try:
        result = coro
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_non_engines_cannot_replace_list_or_read_blocks(kvstore: Node, pki: Pki) -> None:
    engine = KvStoreClient(kvstore.address, tls=pki.by_role["prefill"])
    chain = make_chain(2, salt=b"tenant-a")
    try:
        assert (await engine.put(chain)).stored == 2
    finally:
        await engine.close()
    keys = [b.key for b in chain]
    forged = common_pb2.BlockChunk(meta=common_pb2.BlockMeta(key=keys[0], model_id=MODEL), data=b"\0" * 1024, last=True)

    async def attack(tls) -> dict[str, grpc.StatusCode]:
        async with open_channel(kvstore.address, tls) as channel:
            stub = kvstore_pb2_grpc.KvStoreStub(channel)
            return {
                "Remove": await _status(stub.Remove(kvstore_pb2.KeysRequest(keys=keys), timeout=5)),
                "Put": await _status(stub.Put(iter([forged]), timeout=5)),
                "List": await _status(stub.List(kvstore_pb2.ListRequest(), timeout=5)),
                "Get": await _status(stub.Get(kvstore_pb2.GetRequest(keys=keys, model_id=MODEL), timeout=5)),
            }

    denied = grpc.StatusCode.PERMISSION_DENIED
    assert await attack(pki.by_role["gateway"]) == dict.fromkeys(["Remove", "Put", "List", "Get"], denied)
    assert await attack(pki.by_role["scheduler"]) == dict.fromkeys(["Remove", "Put", "List", "Get"], denied)
    assert set((await attack(None)).values()) == {grpc.StatusCode.UNAVAILABLE}
    assert set((await attack(pki.other_ca)).values()) == {grpc.StatusCode.UNAVAILABLE}
    # Engines write and read, but listing every tenant's blocks is for operators only.
    async with open_channel(kvstore.address, pki.by_role["prefill"]) as channel:
        assert await _status(kvstore_pb2_grpc.KvStoreStub(channel).List(kvstore_pb2.ListRequest(), timeout=5)) == denied

    # The blocks are still there, unchanged, as the admin role sees them.
    admin = KvStoreClient(kvstore.address, tls=pki.by_role["admin"])
    try:
        listed = await admin.list_blocks()
        assert listed is not None and {b.key for b in listed.blocks} >= set(keys)
        got = await admin.get(keys, MODEL)
        assert all(bytes(got[b.key].payload) == bytes(b.payload) for b in chain)
    finally:
        await admin.close()
