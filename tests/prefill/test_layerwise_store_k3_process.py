"""The layer-wise kvstore export of a kimi_k3 prompt through real prefill and kvstore processes.

What a user would notice: with ``layerwise_kvstore`` on (the default) a cold kimi-k3-nano
prompt's new blocks reach the node through its pool as the prompt computes
(``crescent_kv_mover_bytes{mover="shm-layers"}``) and read back exactly as the whole-block
export after the prompt stores them — latents, and the KDA states the snapshot pool still kept —
which is what the setting off still does (``mover="shm"``). (How much lands before the prompt's
last layer, which a loaded machine's timing decides here, is checked paced in
``test_layerwise_store_k3.py``.)
"""

from __future__ import annotations

import grpc
import pytest
import torch

from crescent.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.decode.process import DecodeProcess, SchedulerStandIn
from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture)
from tests.prefill.test_layerwise_store_process import stored_blocks

pytestmark = pytest.mark.slow  # real processes

MODEL, PAGE, VOCAB, MIB = "kimi-k3-nano", 16, 163840, 1 << 20
BLOCKS = 10  # and 9 tokens: 4 forwards of 48 tokens, the last completing one block


def test_a_k3_prompt_streams_into_the_node_and_reads_back_as_the_whole_export_stores_it(tmp_path, kvstore_node) -> None:  # noqa: F811
    scheduler = SchedulerStandIn()
    nodes = {name: kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}}, name=name) for name in ("on", "off")}
    engine = {"model": MODEL, "kv_capacity_tokens": 1024, "block_size": PAGE, "threads": 1, "min_cached_prompt_tokens": 0,
              "prefill_chunk_tokens": 3 * PAGE, "state_snapshots": 4,  # a small pool: snapshots evicted on the way
              "state_snapshot_every_blocks": 1}  # at every block (the default keeps every 16th)
    prefills = {}
    for name, node in nodes.items():
        (tmp_path / name).mkdir()
        prefills[name] = DecodeProcess(tmp_path / name, scheduler.address, 1024, role="prefill",
                                       extra={"kvstore_address": node.address, "layerwise_kvstore": name == "on",
                                              "engine": engine})
    tokens = torch.randint(2, VOCAB - 8, (BLOCKS * PAGE + 9,), generator=torch.Generator().manual_seed(7)).tolist()
    try:
        for process in prefills.values():
            process.start()
        for name, process in prefills.items():
            with grpc.insecure_channel(process.address) as channel:
                events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"r-{name}", token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=1),
                ), timeout=120))
            assert events[0].first_token.finished
        on, off = (stored_blocks(nodes[name].address, BLOCKS) for name in ("on", "off"))
        assert len(on) == BLOCKS and [b.to_meta() for b in on] == [b.to_meta() for b in off]
        assert [bytes(b.payload) for b in on] == [bytes(b.payload) for b in off]
        assert sum(len(b.shape) == 1 for b in on) == 4  # the blocks whose snapshots the pool kept carry them
        kv_bytes = sum(b.nbytes for b in on)
        mover = "crescent_kv_mover_bytes_total"
        assert prefills["on"].metric(mover, mover="shm-layers", direction="put") == kv_bytes
        assert prefills["on"].metric(mover, mover="shm", direction="put") == 0
        assert prefills["off"].metric(mover, mover="shm-layers", direction="put") == 0
        assert prefills["off"].metric(mover, mover="shm", direction="put") == kv_bytes
        assert prefills["off"].metric("crescent_engine_kv_transfer_bytes_total", direction="to_kvstore_hidden") == 0
    finally:
        for process in prefills.values():
            process.stop()
        scheduler.stop()
