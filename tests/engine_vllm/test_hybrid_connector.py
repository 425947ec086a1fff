"""CrescentConnector's hybrid half without a running vLLM: which KV cache groups it carries,
where a prefix hit may resume (the last block whose recurrent-state snapshot was saved), which
snapshots it saves (those vLLM keeps at boundaries the step passed), and that a snapshot of
another layout or a missing one makes the whole request a miss, with nothing written into vLLM's
cache. The same on real vLLM processes: test_vllm_hybrid.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from crescent.services.engine_vllm.connector_metadata import LoadSpec, StateSaveSpec
from crescent.services.engine_vllm.connector_options import ConnectorOptions, tenant_salt
from crescent.services.engine_vllm.connector_scheduler import HANDOFF_KEYS, ConnectorScheduler
from crescent.services.engine_vllm.connector_worker import ConnectorWorker
from crescent.services.engine_vllm.hybrid_layout import GroupLayout, group_layout, resume_point, state_key
from crescent.services.contract.block_keys import BlockKey, prefix_block_keys
from crescent.services.kvwire.kv_block import KvBlock

BLOCK, MODEL, FORMAT = 4, "tiny-hybrid", "vllm-state-v1:test"


class FullAttentionSpec:
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(FullAttentionSpec):
    pass


class MambaSpec:
    def __init__(self, mode: str = "align") -> None:
        self.mamba_cache_mode = mode


def config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.x"])
                                            for i, spec in enumerate(specs)])


HYBRID = group_layout(config(MambaSpec(), MambaSpec(), MLAAttentionSpec()))


def test_groups_are_carried_only_where_a_block_names_a_prefix() -> None:
    assert (HYBRID.attention_groups, HYBRID.state_groups, HYBRID.carried) == ((2,), (0, 1), True)
    assert group_layout(None) == GroupLayout((0,), (), {})
    assert "SlidingWindowSpec" in group_layout(config(FullAttentionSpec(), SlidingWindowSpec())).unsupported
    assert "'none'" in group_layout(config(MambaSpec("none"), FullAttentionSpec())).unsupported


def test_a_hit_resumes_at_the_last_saved_snapshot_at_or_below_the_stored_prefix() -> None:
    assert resume_point([True, True, True, True], [False, True, False, False]) == 2
    assert resume_point([True, True, False, True], [False, False, False, True]) == 0, "a gap ends the prefix"
    assert resume_point([True, True, True], [True, True, True]) == 3
    assert resume_point([], []) == 0


def test_a_snapshot_key_names_the_block_its_tenant_and_its_format() -> None:
    tokens = list(range(8))
    acme = prefix_block_keys(tokens, BLOCK, MODEL, b"acme")[1]
    globex = prefix_block_keys(tokens, BLOCK, MODEL, b"globex")[1]
    assert state_key(acme, FORMAT) != state_key(globex, FORMAT)
    assert state_key(acme, FORMAT) != state_key(acme, FORMAT + ":another-conv-layout")
    assert state_key(acme, FORMAT) not in (acme, globex)


class Link:
    """The kvstore as the scheduler side asks it: which keys it holds."""

    def __init__(self, held: set[bytes]) -> None:
        self.held = held

    def present(self, keys: list[bytes]) -> list[bool]:
        return [bytes(k) in self.held for k in keys]

    def leading_hits(self, keys: list[bytes]) -> int:
        return resume_point(self.present(keys), [True] * len(keys))


def request(tokens: list[int], tenant: bytes = b"acme") -> SimpleNamespace:
    return SimpleNamespace(request_id=f"r1-{tenant.decode()}" if tenant != b"acme" else "r1", prompt_token_ids=tokens,
                           cache_salt=tenant_salt(tenant))


def test_the_scheduler_loads_a_hybrid_prefix_asynchronously_up_to_its_snapshot() -> None:
    tokens = list(range(18))  # four full blocks and two tokens
    keys = prefix_block_keys(tokens, BLOCK, MODEL, b"acme")
    held = {bytes(k) for k in keys} | {state_key(keys[1], FORMAT)}  # every block, one snapshot (after block 1)
    scheduler = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(held), HYBRID, FORMAT)
    assert scheduler.matched_tokens(request(tokens), 0) == (2 * BLOCK, True)
    # vLLM's tables after allocation: two state groups (null interior blocks), one attention group
    scheduler.after_alloc(request(tokens), ([0, 11, 0, 0, 0], [0, 12, 0, 0, 0], [5, 6, 7, 8, 9]), 2 * BLOCK)
    meta = scheduler.build_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
    assert meta.loads == [LoadSpec("r1", tuple(keys[:2]), (tuple(tokens[:4]), tuple(tokens[4:8])), ((5, 6),),
                                   state_key(keys[1], FORMAT), (11, 12))]
    assert scheduler.matched_tokens(request(tokens, b"globex"), 0) == (0, False), "another tenant's keys"
    # A prefill resumed from the store hands decode the same point (it saved no later snapshot).
    resume = [k.hex() for k in [*map(bytes, keys[:2]), state_key(keys[1], FORMAT)]]
    assert scheduler.finished(request(tokens)) == {HANDOFF_KEYS: resume}


def test_the_scheduler_saves_the_snapshots_vllm_keeps_at_boundaries_the_step_passed() -> None:
    tokens = list(range(18))
    keys = prefix_block_keys(tokens, BLOCK, MODEL, b"acme")
    scheduler = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(set()), HYBRID, FORMAT)
    pool = {i: SimpleNamespace(block_id=i, is_null=i == 0, block_hash=None) for i in range(20)}
    scheduler.pool = SimpleNamespace(blocks=pool)
    assert scheduler.matched_tokens(request(tokens), 0) == (0, False)
    scheduler.after_alloc(request(tokens), ([], [], []), 0)
    for block_id in (11, 12, 13, 14):  # vLLM cached the states after blocks 1 and 3 (ids 11/12, 13/14)
        pool[block_id].block_hash = b"h"
    step = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([0, 11, 0, 13], [0, 12, 0, 14], [5, 6, 7, 8]),
                                            num_computed_tokens=0)],
        num_scheduled_tokens={"r1": 16}, scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
    meta = scheduler.build_meta(step)
    assert [s.block_ids for s in meta.saves] == [(5,), (6,), (7,), (8,)]
    assert meta.state_saves == [StateSaveSpec(state_key(keys[1], FORMAT), tuple(tokens[4:8]), (11, 12)),
                                StateSaveSpec(state_key(keys[3], FORMAT), tuple(tokens[12:16]), (13, 14))]
    # What a vLLM prefill waits for before its handoff: the blocks up to the last snapshot, and it.
    resume = scheduler.finished(request(tokens))
    assert resume == {HANDOFF_KEYS: [k.hex() for k in [*map(bytes, keys[:4]), state_key(keys[3], FORMAT)]]}


def test_the_handoff_point_is_the_last_snapshot_decode_may_load() -> None:
    tokens = list(range(16))  # four full blocks: the last token is computed, so three are loadable
    keys = prefix_block_keys(tokens, BLOCK, MODEL, b"acme")
    scheduler = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(set()), HYBRID, FORMAT)
    pool = {i: SimpleNamespace(block_id=i, is_null=i == 0, block_hash=b"h" if i in (11, 12, 13, 14) else None)
            for i in range(20)}
    scheduler.pool = SimpleNamespace(blocks=pool)
    scheduler.matched_tokens(request(tokens), 0)
    scheduler.after_alloc(request(tokens), ([], [], []), 0)
    scheduler.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([0, 11, 0, 13], [0, 12, 0, 14], [5, 6, 7, 8]),
                                            num_computed_tokens=0)],
        num_scheduled_tokens={"r1": 16}, scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
    resume = scheduler.finished(request(tokens))[HANDOFF_KEYS]
    assert resume == [k.hex() for k in [*map(bytes, keys[:2]), state_key(keys[1], FORMAT)]], \
        "the snapshot after block 3 is past the last loadable block: decode resumes after block 1"
    bare = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(set()), HYBRID, FORMAT)
    bare.matched_tokens(request(tokens), 0)
    assert bare.finished(request(tokens)) == {HANDOFF_KEYS: []}, "no snapshot: decode computes it all"
    attention = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(set()))
    attention.matched_tokens(request(tokens), 0)
    assert attention.finished(request(tokens)) is None, "attention-only: prefill names the blocks itself"


class Store:
    def __init__(self) -> None:
        self.blocks: dict[bytes, KvBlock] = {}
        self.put: list[KvBlock] = []

    def get_prefix(self, keys: list[BlockKey]) -> list[KvBlock]:
        found = []
        for key in keys:
            if bytes(key) not in self.blocks:
                break
            found.append(self.blocks[bytes(key)])
        return found

    def put_soon(self, blocks: list[KvBlock]) -> object:
        self.put.extend(blocks)
        return object()


STATE_BYTES, BLOCKS = 24, 16


def hybrid_worker(store: Store) -> ConnectorWorker:
    layout = GroupLayout((1,), (0,), {"model.layers.0.linear_attn": 0, "model.layers.1.self_attn.attn": 1})
    worker = ConnectorWorker(ConnectorOptions(MODEL, BLOCK), store, "cpu-vec", BLOCKS, layout)
    worker.register({"model.layers.0.linear_attn": torch.zeros(BLOCKS, 1, 1, STATE_BYTES, dtype=torch.int8),
                     "model.layers.1.self_attn.attn": torch.full((BLOCKS, 2, BLOCK, 16), float("nan"))})
    return worker


def store_hybrid_prefix(store: Store, worker: ConnectorWorker, tokens: list[int], state: bytes) -> list[BlockKey]:
    assert worker.geo is not None
    keys = prefix_block_keys(tokens, BLOCK, MODEL, b"acme")
    for i, key in enumerate(keys):
        payload = torch.randn(worker.geo.block_shape)
        store.blocks[bytes(key)] = KvBlock.build(key, None, MODEL, "float32", worker.geo.block_shape,
                                                 tokens[i * BLOCK:(i + 1) * BLOCK], memoryview(payload.numpy()).cast("B"))
    snapshot = state_key(keys[-1], FORMAT)
    store.blocks[snapshot] = KvBlock.build(BlockKey(snapshot), None, MODEL, "uint8", (len(state),),
                                           tokens[-BLOCK:], state)
    return keys


def load_meta(keys: list[BlockKey], tokens: list[int]) -> SimpleNamespace:
    spec = LoadSpec("r1", tuple(keys), tuple(tuple(tokens[i * BLOCK:(i + 1) * BLOCK]) for i in range(len(keys))),
                    ((3, 4),), state_key(keys[-1], FORMAT), (9,))
    return SimpleNamespace(loads=[spec], saves=[])


def wait_done(worker: ConnectorWorker) -> tuple[set[str], set[str]]:
    for _ in range(500):
        done, failed = worker.transfer_results()
        if done:
            return done, failed
        time.sleep(0.01)
    raise AssertionError("the hybrid load never finished")


def test_a_hybrid_load_places_blocks_and_snapshot_then_reports_the_request() -> None:
    store, tokens = Store(), list(range(8))
    worker = hybrid_worker(store)
    state = bytes(range(STATE_BYTES))
    keys = store_hybrid_prefix(store, worker, tokens, state)
    worker.load(load_meta(keys, tokens))
    assert wait_done(worker) == ({"r1"}, set())
    assert bytes(worker.state_layers[0][9].view(torch.uint8).reshape(-1).tolist()) == state
    assert not torch.isnan(worker.layers[0][3]).any() and not torch.isnan(worker.layers[0][4]).any()


def test_a_snapshot_of_another_layout_or_none_fails_the_request_and_writes_nothing() -> None:
    for state in (bytes(STATE_BYTES + 8), None):  # another state size (layout), or no snapshot at all
        store, tokens = Store(), list(range(8))
        worker = hybrid_worker(store)
        keys = store_hybrid_prefix(store, worker, tokens, state or bytes(STATE_BYTES))
        if state is None:
            del store.blocks[state_key(keys[-1], FORMAT)]
        worker.load(load_meta(keys, tokens))
        assert wait_done(worker) == ({"r1"}, {"r1"}), "vLLM recomputes the request from its start"
        assert torch.isnan(worker.layers[0][3]).all() and not worker.state_layers[0][9].any()


def test_a_saved_snapshot_is_the_state_layers_bytes_after_the_forward() -> None:
    store = Store()
    worker = hybrid_worker(store)
    worker.state_layers[0][6].copy_(torch.arange(STATE_BYTES, dtype=torch.int8).view(1, 1, STATE_BYTES))
    key = state_key(b"k" * 16, FORMAT)
    worker.finish_saves(SimpleNamespace(saves=[], state_saves=[StateSaveSpec(key, (1, 2, 3, 4), (6,))]))
    (block,) = store.put
    assert (bytes(block.key), block.dtype, block.shape, block.token_ids) == (key, "uint8", (STATE_BYTES,), (1, 2, 3, 4))
    assert bytes(block.payload) == bytes(range(STATE_BYTES))


def test_a_model_with_groups_it_cannot_name_starts_with_the_connector_passive() -> None:
    layout = group_layout(config(SlidingWindowSpec(), SlidingWindowSpec()))
    worker = ConnectorWorker(ConnectorOptions(MODEL, BLOCK), Store(), "cpu-vec", BLOCKS, layout)
    worker.register({"model.layers.0.x": torch.zeros(BLOCKS, 2, BLOCK, 16),
                     "model.layers.1.x": torch.zeros(BLOCKS, 2, BLOCK, 16)})  # no error: passive
    assert worker.link is None and worker.geo is None
    scheduler = ConnectorScheduler(ConnectorOptions(MODEL, BLOCK), Link(set()), layout, "")
    assert scheduler.matched_tokens(request(list(range(18))), 0) == (0, False)
    assert scheduler.finished(request(list(range(18)))) == {HANDOFF_KEYS: []}, "a prefill waits for nothing"
