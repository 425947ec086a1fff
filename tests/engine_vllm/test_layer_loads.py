"""The connector's loads finish layer by layer: ``start_load_kv`` returns before the blocks are in
vLLM's cache, each attention layer's wait returns once its own layer is written (and not before),
and a block that is missing, refused or half-written is a load error (vLLM recomputes it), never
rows an attention layer would read as if they were the prompt's. No vLLM process: the worker half
of the connector on tensors laid out as vLLM's CPU build lays them out."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from crescent.services.engine_vllm import connector_worker
from crescent.services.engine_vllm.connector_metadata import LoadSpec
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.connector_worker import ConnectorWorker
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 4, 2, 16, 8, 12
MODEL = "tiny"
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class Store:
    """Stands in for the kvstore link: the blocks it holds, by key."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, KvBlock] = {}

    def get_prefix(self, keys: list[BlockKey]) -> list[KvBlock]:
        found = []
        for key in keys:
            if bytes(key) not in self.blocks:
                break
            found.append(self.blocks[bytes(key)])
        return found


def worker_with(store: Store) -> ConnectorWorker:
    worker = ConnectorWorker(ConnectorOptions(model_id=MODEL, block_size=BLOCK), store, "cpu-vec", BLOCKS)
    # NaN everywhere: a row nobody wrote can never pass for KV
    worker.register({name: torch.full((BLOCKS, HEADS, BLOCK, 2 * DIM), float("nan")) for name in NAMES})
    return worker


def stored_block(store: Store, worker: ConnectorWorker, n: int, tokens: tuple[int, ...]) -> torch.Tensor:
    """A block in the store under key ``n``; its payload ``[layers, 2, tokens, heads, dim]``."""
    assert worker.geo is not None
    payload = torch.randn(worker.geo.block_shape, generator=torch.Generator().manual_seed(n))
    key = BlockKey(bytes([n]) * 16)
    store.blocks[bytes(key)] = KvBlock.build(key, None, MODEL, "float32", worker.geo.block_shape, tokens,
                                             memoryview(payload.numpy()).cast("B"))
    return payload


def layer_rows(worker: ConnectorWorker, layer: int, block_id: int) -> torch.Tensor:
    """What an attention layer reads of one block, in the payload's ``[2, tokens, heads, dim]``."""
    assert worker.geo is not None
    out = torch.empty(worker.geo.block_shape[1:])
    connector_worker.read_layer(worker.geo, worker.layers[layer], block_id, out)
    return out


def meta(*loads: tuple[list[int], list[tuple[int, ...]], list[int]]) -> SimpleNamespace:
    specs = [LoadSpec(f"r{i}", tuple(bytes([n]) * 16 for n in keys), tuple(tokens), (tuple(block_ids),))
             for i, (keys, tokens, block_ids) in enumerate(loads)]
    return SimpleNamespace(loads=specs, saves=[])


def tokens(n: int) -> tuple[int, ...]:
    return tuple(range(n * BLOCK, (n + 1) * BLOCK))


class Gates:
    """The loader writes a layer only once that layer's gate opens."""

    def __init__(self) -> None:
        self.open = [threading.Event() for _ in range(LAYERS)]
        self.layers: list[torch.Tensor] = []  # the worker's layer tensors, once registered


@pytest.fixture
def gates(monkeypatch: pytest.MonkeyPatch) -> Gates:
    gates = Gates()
    write = connector_worker.write_layer

    def gated_write(geo, view, block_id, src) -> None:  # noqa: ANN001
        layer = next(i for i, known in enumerate(gates.layers) if view is known)
        assert gates.open[layer].wait(10), "the test never opened this layer's gate"
        write(geo, view, block_id, src)

    monkeypatch.setattr(connector_worker, "write_layer", gated_write)
    return gates


def test_each_layer_is_awaited_before_its_attention_reads_it(gates: Gates) -> None:
    store = Store()
    worker = worker_with(store)
    gates.layers = worker.layers
    payloads = [stored_block(store, worker, n, tokens(n)) for n in range(2)]

    started = time.monotonic()
    worker.load(meta(([0, 1], [tokens(0), tokens(1)], [5, 9])))
    assert time.monotonic() - started < 1, "start_load_kv only starts the loads"
    assert torch.isnan(layer_rows(worker, 0, 5)).all(), "nothing is written before the loader gets to it"

    for layer, name in enumerate(NAMES):
        waiting = threading.Thread(target=worker.wait_for_layer, args=(name,))
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive(), f"layer {layer}'s attention waits while its layer is not written"
        gates.open[layer].set()
        waiting.join(10)
        assert not waiting.is_alive()
        for block_id, payload in zip((5, 9), payloads):  # what its attention reads now is the stored KV
            assert torch.equal(layer_rows(worker, layer, block_id), payload[layer])
        if layer + 1 < LAYERS:
            assert torch.isnan(layer_rows(worker, layer + 1, 5)).all(), "the next layer is still on its way"
    assert worker.take_load_errors() == set()
    assert worker.loaded_blocks == 2


def test_a_missing_or_refused_block_is_a_load_error_never_read_as_kv() -> None:
    store = Store()
    worker = worker_with(store)
    first = stored_block(store, worker, 0, tokens(0))
    stored_block(store, worker, 1, tokens(7))  # its tokens are not the prompt's: refused
    stored_block(store, worker, 2, tokens(2))  # after a refused block: not loaded either
    other = stored_block(store, worker, 3, tokens(3))
    # request A: blocks 0, 1, 2; request B: block 3 then one the store does not hold (key 4)
    worker.load(meta(([0, 1, 2], [tokens(0), tokens(1), tokens(2)], [1, 2, 3]),
                     ([3, 4], [tokens(3), tokens(4)], [6, 7])))
    for name in NAMES:
        worker.wait_for_layer(name)
    assert worker.take_load_errors() == {2, 3, 7}, "vLLM recomputes from the first block that did not load"
    for layer in range(LAYERS):
        assert torch.equal(layer_rows(worker, layer, 1), first[layer])
        assert torch.equal(layer_rows(worker, layer, 6), other[layer])
        for block_id in (2, 3, 7):
            assert torch.isnan(layer_rows(worker, layer, block_id)).all(), "a refused block is never written"
    assert worker.take_load_errors() == set(), "errors are reported once"


def test_a_load_that_fails_half_way_is_a_miss_and_no_layer_waits_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store()
    worker = worker_with(store)
    for n in range(2):
        stored_block(store, worker, n, tokens(n))
    write = connector_worker.write_layer

    def failing_write(geo, view, block_id, src) -> None:  # noqa: ANN001
        if view is worker.layers[2]:
            raise RuntimeError("copy failed")
        write(geo, view, block_id, src)

    monkeypatch.setattr(connector_worker, "write_layer", failing_write)
    worker.load(meta(([0, 1], [tokens(0), tokens(1)], [4, 8])))
    waits = [threading.Thread(target=worker.wait_for_layer, args=(name,)) for name in NAMES]
    for wait in waits:
        wait.start()
    for wait in waits:
        wait.join(10)
        assert not wait.is_alive(), "every layer's wait returns even when the load failed"
    assert worker.take_load_errors() == {4, 8}, "half-written blocks are recomputed"
    assert worker.loaded_blocks == 0


def test_a_step_without_loads_waits_for_nothing() -> None:
    worker = worker_with(Store())
    worker.load(meta())
    started = time.monotonic()
    for name in NAMES:
        worker.wait_for_layer(name)
    assert time.monotonic() - started < 0.1
    assert worker.take_load_errors() == set()
