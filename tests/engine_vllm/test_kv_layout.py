"""The connector's pieces that need no running vLLM: vLLM's paged layer views against the native
engine's block layout, the block-event set the instance keeps, and the options' salts."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from crescent.protos import common_pb2
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine_vllm.block_events import BlockEventSender, EngineBlockSet
from crescent.services.engine_vllm.connector_options import (
    PRIVATE_SALT_PREFIX, ConnectorOptions, crescent_salt, tenant_salt,
)
from crescent.services.engine_vllm.kv_layout import geometry, read_layer, write_block

LAYERS, HEADS, BLOCK, DIM, PAGES = 3, 2, 16, 8, 5


def vllm_views_of(cache: PagedKvCache) -> list[torch.Tensor]:
    """What vLLM's CPU build (``vec`` kernels) holds for the same KV, built element by element from
    the native pool ``[pages, layers, 2, tokens, heads, dim]``: per layer a ``[blocks, heads,
    block_size, 2 x dim]`` tensor whose (block, head) memory is the keys dim-major, then the values
    token-major (as measured against a real vLLM: tests/engine_vllm/test_vllm_backend.py)."""
    views = []
    for layer in range(LAYERS):
        view = torch.empty(PAGES, HEADS, BLOCK, 2 * DIM)
        for page in range(PAGES):
            for head in range(HEADS):
                memory = view[page, head].view(-1)
                for token in range(BLOCK):
                    for d in range(DIM):
                        memory[d * BLOCK + token] = cache.pool[page, layer, 0, token, head, d]
                        memory[BLOCK * DIM + token * DIM + d] = cache.pool[page, layer, 1, token, head, d]
        views.append(view)
    return views


def payload_of(geo, views: list[torch.Tensor], page: int) -> torch.Tensor:  # noqa: ANN001
    out = torch.empty(geo.block_shape)
    for layer, view in enumerate(views):
        read_layer(geo, view, page, out[layer])
    return out


def test_a_vllm_cpu_block_is_the_native_engines_block_byte_for_byte() -> None:
    torch.manual_seed(0)
    native = PagedKvCache(PAGES, LAYERS, BLOCK, HEADS, DIM)
    native.pool.copy_(torch.randn_like(native.pool))
    views = vllm_views_of(native)
    geo = geometry(views, "cpu-vec", PAGES)
    assert geo.block_shape == native.block_shape
    assert geo.kv_format == "paged-v1:" + "x".join(map(str, native.block_shape))
    for page in range(PAGES):
        assert torch.equal(payload_of(geo, views, page), native.read_block(page))


def test_a_native_block_written_into_vllm_views_reads_back_the_same() -> None:
    torch.manual_seed(1)
    native = PagedKvCache(PAGES, LAYERS, BLOCK, HEADS, DIM)
    native.pool.copy_(torch.randn_like(native.pool))
    views = [torch.full((PAGES, HEADS, BLOCK, 2 * DIM), float("nan")) for _ in range(LAYERS)]
    geo = geometry(views, "cpu-vec", PAGES)
    write_block(geo, views, 3, native.read_block(1))
    assert torch.equal(payload_of(geo, views, 3), native.read_block(1))
    assert torch.equal(views[0][3], vllm_views_of(native)[0][1]), "the very memory layout vLLM's kernels read"
    assert torch.isnan(views[0][2]).all(), "other blocks untouched"


def test_another_layout_is_kept_as_vllm_holds_it_under_its_own_format() -> None:
    views = [torch.randn(2, PAGES, BLOCK, HEADS, DIM) for _ in range(LAYERS)]  # e.g. a GPU backend's [2, blocks, ...]
    geo = geometry(views, "cuda", PAGES)
    assert geo.block_dim == 1 and geo.block_shape == (LAYERS, 2, BLOCK, HEADS, DIM)
    assert geo.kv_format.startswith("vllm-cuda:"), "never taken for the native layout"
    payload = payload_of(geo, views, 4)
    assert torch.equal(payload[1], views[1][:, 4])
    fresh = [torch.zeros_like(v) for v in views]
    write_block(geo, fresh, 4, payload)
    assert torch.equal(fresh[2][:, 4], views[2][:, 4])


def test_layers_that_disagree_or_lack_their_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="differ"):
        geometry([torch.zeros(2, 2, 4, 8), torch.zeros(2, 3, 4, 8)], "cpu-vec", 2)
    with pytest.raises(ValueError, match="blocks"):
        geometry([torch.zeros(3, 2, 4, 8)], "cpu-vec", 7)


def test_salts_round_trip_and_private_prompts_stay_private() -> None:
    assert crescent_salt(tenant_salt(b"\x01\xfe")) == b"\x01\xfe"
    assert crescent_salt(tenant_salt(b"")) == b""
    assert crescent_salt(PRIVATE_SALT_PREFIX + "abc") is None
    assert crescent_salt("somebody-else's-salt") is None, "a salt Crescent did not set is never shared"
    options = ConnectorOptions(model_id="m", block_size=64, kvstore_address="127.0.0.1:1")
    assert ConnectorOptions.from_extra_config(options.to_extra_config()) == options
    with pytest.raises(ValueError, match="unknown option"):
        ConnectorOptions.from_extra_config({"crescent": {"model_id": "m", "block_size": 64, "typo": 1}})


def _event(kind: int, key: bytes, parent: bytes = b"") -> common_pb2.BlockEvent:
    return common_pb2.BlockEvent(kind=kind, key=key, parent_key=parent, tier=common_pb2.KV_TIER_ENGINE, num_tokens=64)


async def test_block_events_reach_the_instance_over_its_socket(tmp_path) -> None:  # noqa: ANN001
    held = EngineBlockSet(64)
    path = str(tmp_path / "events.sock")
    await held.listen(path)
    sender = BlockEventSender(path)
    stored, removed = common_pb2.BLOCK_EVENT_STORED, common_pb2.BLOCK_EVENT_REMOVED
    sender.send([_event(stored, b"a"), _event(stored, b"b", b"a"), _event(stored, b"a")])
    sender.send([_event(removed, b"a"), _event(removed, b"zz")])
    for _ in range(200):
        if b"a" not in held.held and b"b" in held.held:
            break
        await asyncio.sleep(0.01)
    events = held.drain_events()
    assert [(e.kind, e.key) for e in events] == [(stored, b"a"), (stored, b"b"), (removed, b"a")], \
        "a repeated store and the removal of an unknown block are not news"
    assert [(e.key, e.parent_key) for e in held.snapshot()] == [(b"b", b"a")]
    sender.close()
    await held.close()


async def test_a_frame_too_large_closes_the_connection_and_the_set_keeps_serving(tmp_path) -> None:  # noqa: ANN001
    held = EngineBlockSet(64)
    path = str(tmp_path / "events.sock")
    await held.listen(path)
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(path)
        raw.sendall((1 << 30).to_bytes(4, "little"))
        await asyncio.sleep(0.05)
    sender = BlockEventSender(path)
    sender.send([_event(common_pb2.BLOCK_EVENT_STORED, b"k")])
    for _ in range(200):
        if b"k" in held.held:
            break
        await asyncio.sleep(0.01)
    assert b"k" in held.held
    sender.close()
    await held.close()
