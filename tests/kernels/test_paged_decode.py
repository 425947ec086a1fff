"""The C++ decode attention over the paged pool (kernels/cpu/paged_decode.cpp).

It must give what attention over gathered pages gives (the PyTorch path, up to float rounding),
give every row the same bits whatever it is batched with and however many threads run it (the
disaggregated promise: a request's tokens do not depend on its neighbours), and refuse a page
table that would read outside the pool.
"""

from __future__ import annotations

import math

import pytest
import torch

from crescent.kernels.cpu import paged_attention
from crescent.kernels.cpu.cpu_ext import paged_decode_ops

PAGES, LAYERS, PAGE, KV, HEADS, DIM = 40, 3, 64, 3, 9, 64  # SmolLM2-135M's heads in a small pool
SCALE = 1 / math.sqrt(DIM)


@pytest.fixture(scope="module")
def ops():
    built = paged_decode_ops()
    assert built is not None, "the C++ op did not build (make install builds it; g++ and ninja are needed)"
    return built


def pool_and_batch(seed: int, lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(PAGES, LAYERS, 2, PAGE, KV, DIM, generator=gen)
    order = torch.randperm(PAGES, generator=gen).tolist()
    tables, taken = [], 0
    for length in lens:
        need = -(-length // PAGE)
        tables.append(order[taken: taken + need])
        taken += need
    widest = max(len(t) for t in tables)
    padded = torch.zeros(len(lens), widest, dtype=torch.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = torch.tensor(table)
    q = torch.randn(len(lens), HEADS, DIM, generator=gen)
    return pool, tables, padded, torch.tensor(lens, dtype=torch.int64), q


def test_equals_attention_over_gathered_pages(ops) -> None:
    lens = [1, 63, 64, 65, 130, 200]
    pool, tables, padded, context, q = pool_and_batch(0, lens)
    layer = pool[:, 1]
    out = ops.paged_decode_attention(q, layer[:, 0], layer[:, 1], padded, context, SCALE)
    for row, (table, length) in enumerate(zip(tables, lens)):
        index = torch.tensor(table)
        expect = paged_attention(q[row: row + 1], layer[:, 0][index].contiguous(), layer[:, 1][index].contiguous(),
                                 length, SCALE)
        torch.testing.assert_close(out[row], expect[0], rtol=1e-5, atol=1e-6)


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_threads(ops) -> None:
    lens = [70, 5, 190, 128, 33, 64, 1, 99]
    pool, _, padded, context, q = pool_and_batch(1, lens)
    layer = pool[:, 2]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [ops.paged_decode_attention(q[r: r + 1].contiguous(), layer[:, 0], layer[:, 1],
                                           padded[r: r + 1, : -(-lens[r] // PAGE)].contiguous(), context[r: r + 1],
                                           SCALE)[0] for r in range(len(lens))]
        torch.set_num_threads(2)
        together = ops.paged_decode_attention(q, layer[:, 0], layer[:, 1], padded, context, SCALE)
        reversed_batch = ops.paged_decode_attention(q.flip(0).contiguous(), layer[:, 0], layer[:, 1],
                                                    padded.flip(0).contiguous(), context.flip(0).contiguous(), SCALE)
    finally:
        torch.set_num_threads(threads)
    for r in range(len(lens)):
        assert torch.equal(together[r], alone[r]), f"row {r} changed in a batch"
        assert torch.equal(reversed_batch[len(lens) - 1 - r], alone[r]), f"row {r} changed with its position"


@pytest.mark.parametrize("bad", ["page outside the pool", "length past the table", "empty context"])
def test_a_bad_table_is_refused_not_read(ops, bad: str) -> None:
    pool, _, padded, context, q = pool_and_batch(2, [100, 20])
    layer = pool[:, 0]
    if bad == "page outside the pool":
        padded[0, 1] = PAGES
    elif bad == "length past the table":
        context[1] = padded.shape[1] * PAGE + 1
    else:
        context[0] = 0
    with pytest.raises(RuntimeError, match="outside the pool|not covered"):
        ops.paged_decode_attention(q, layer[:, 0], layer[:, 1], padded, context, SCALE)


def test_where_it_cannot_be_built_the_engine_gets_none_not_an_error(tmp_path, monkeypatch) -> None:
    from crescent.kernels.cpu import cpu_ext

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache folder should go")
    monkeypatch.setenv("CRESCENT_KERNEL_CACHE", str(blocked))
    cpu_ext.paged_decode_ops.cache_clear()
    try:
        assert cpu_ext.paged_decode_ops() is None
        monkeypatch.setenv("CRESCENT_KERNEL_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CRESCENT_CPU_KERNELS", "0")
        cpu_ext.paged_decode_ops.cache_clear()
        assert cpu_ext.paged_decode_ops() is None  # turned off: not even built
        assert not (tmp_path / "cache").exists()
    finally:
        cpu_ext.paged_decode_ops.cache_clear()
