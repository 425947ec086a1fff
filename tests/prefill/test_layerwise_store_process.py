"""The layer-wise kvstore export through real prefill and kvstore processes, on and off.

What a user would notice: with ``layerwise_kvstore`` on (the default) a cold prompt's new blocks
reach the node a layer at a time (``crescent_kv_mover_bytes{mover="shm-layers"}``) and read back
exactly as the whole-block export after the prompt stores them, which is what the setting off
still does (``mover="shm"``); a prompt whose caller leaves midway stores nothing and gives its
reserved room back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import torch

from crescent.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.kvstore.client import KvStoreClient
from tests.decode.process import BLOCK, DecodeProcess, SchedulerStandIn
from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # real processes: a model load each

MIB = 1 << 20
PROMPT = 4 * BLOCK + 44  # 4 full blocks (over the 256-token cache rule) and a partial one
CHUNK = 2 * BLOCK  # two chunks and a bit: blocks committed while later chunks compute


def prefill_process(run_dir: Path, scheduler: str, kvstore: str, layerwise: bool) -> DecodeProcess:
    engine = {"kv_capacity_tokens": 8 * BLOCK, "block_size": BLOCK, "threads": 1, "prefill_chunk_tokens": CHUNK}
    run_dir.mkdir()
    return DecodeProcess(run_dir, scheduler, 8 * BLOCK, role="prefill",
                         extra={"kvstore_address": kvstore, "layerwise_kvstore": layerwise, "engine": engine})


def stored_blocks(address: str, want: int) -> list:
    """The node's blocks once it holds ``want`` of them, by key order."""
    async def main():
        client = KvStoreClient(address, shared_memory=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listed = await client.list_blocks()
                if listed is not None and len(listed.blocks) >= want:
                    keys = sorted(bytes(b.key) for b in listed.blocks)
                    got = await client.get(keys)
                    return [got[k] for k in keys]
                await asyncio.sleep(0.1)
            raise TimeoutError(f"the node holds fewer than {want} blocks")
        finally:
            await client.close()
    return asyncio.run(main())


def test_on_streams_layers_and_stores_what_the_whole_export_stores(tmp_path, kvstore_node) -> None:  # noqa: F811
    scheduler = SchedulerStandIn()
    nodes = {name: kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}}, name=name) for name in ("on", "off")}
    prefills = {name: prefill_process(tmp_path / name, scheduler.address, nodes[name].address, name == "on")
                for name in nodes}
    tokens = torch.randint(10, 40000, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    try:
        for process in prefills.values():
            process.start()
        for name, process in prefills.items():
            with grpc.insecure_channel(process.address) as channel:
                events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"r-{name}", token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=1),
                ), timeout=120))
            assert events[0].first_token.finished
        on, off = (stored_blocks(nodes[name].address, 4) for name in ("on", "off"))
        assert [b.to_meta() for b in on] == [b.to_meta() for b in off]
        assert [bytes(b.payload) for b in on] == [bytes(b.payload) for b in off]
        kv_bytes = sum(b.nbytes for b in on)
        mover = "crescent_kv_mover_bytes_total"
        assert prefills["on"].metric(mover, mover="shm-layers", direction="put") == kv_bytes
        assert prefills["on"].metric(mover, mover="shm", direction="put") == 0
        assert prefills["off"].metric(mover, mover="shm-layers", direction="put") == 0
        assert prefills["off"].metric(mover, mover="shm", direction="put") == kv_bytes
        hidden = "crescent_engine_kv_transfer_bytes_total"
        # the last chunk has no full block: every layer of every new block landed before the prompt ended
        assert prefills["on"].metric(hidden, direction="to_kvstore_hidden") == kv_bytes
        assert prefills["off"].metric(hidden, direction="to_kvstore_hidden") == 0
    finally:
        for process in prefills.values():
            process.stop()
        scheduler.stop()


def test_a_prompt_cancelled_midway_leaves_no_block_and_gives_its_room_back(tmp_path, kvstore_node) -> None:  # noqa: F811
    scheduler = SchedulerStandIn()
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    engine = {"kv_capacity_tokens": 32 * BLOCK, "block_size": BLOCK, "threads": 1, "prefill_chunk_tokens": 32 * BLOCK}
    (tmp_path / "p").mkdir()
    prefill = DecodeProcess(tmp_path / "p", scheduler.address, 32 * BLOCK, role="prefill",
                            extra={"kvstore_address": node.address, "engine": engine})
    tokens = torch.randint(10, 40000, (16 * BLOCK,), generator=torch.Generator().manual_seed(5)).tolist()

    def host() -> tuple[int, int]:  # (blocks, reserved bytes) of the node's host tier
        async def stat():
            client = KvStoreClient(node.address)
            try:
                return (await client.stat()).tiers[0]
            finally:
                await client.close()
        tier = asyncio.run(stat())
        return tier.blocks, tier.reserved_bytes

    try:
        prefill.start()
        with grpc.insecure_channel(prefill.address) as channel:
            stream = prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="cancelled", token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120)
            deadline = time.monotonic() + 60
            while host()[1] == 0:  # one chunk of 16 blocks: its room is reserved at its first layer
                assert time.monotonic() < deadline, "no room was reserved"
                time.sleep(0.02)
            stream.cancel()  # the caller leaves while the prompt computes
        deadline = time.monotonic() + 60
        while prefill.metric("crescent_engine_requests_total", role="prefill", outcome="aborted") == 0:
            assert time.monotonic() < deadline, "the call did not end"
            time.sleep(0.1)
        with grpc.insecure_channel(prefill.address) as channel:  # queued behind the forward in progress
            list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="after", token_ids=tokens[:10], sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120))
        while host() != (0, 0):
            assert time.monotonic() < deadline, f"the node holds {host()} (blocks, reserved bytes)"
            time.sleep(0.05)
        assert host() == (0, 0)  # no block, and the room went back
        assert prefill.metric("crescent_kv_mover_bytes_total", mover="shm-layers", direction="put") == 0
    finally:
        prefill.stop()
        scheduler.stop()
