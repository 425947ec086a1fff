"""Triton paged attention (decode and varlen prefill) over the engine's KV pool layout.

The pool here is the engine's own shape, (pages, layers, 2, block_size, KV, D), NaN-filled except
for the slots sequences own, with pages handed out in shuffled order; the kernels read one
layer's strided K and V views of it, as the engine passes them. Checked: the float64 oracle
against the engine's CPU path (gather + SDPA); both kernels against the oracle for ragged
lengths, partial and exactly full last pages, GQA ratios 1, 3 (SmolLM2) and 4, block sizes 16 and
64, head dims 64 and 48 (padded in registers), fp32 (rel-RMS 1e-5) and bf16 pools (1e-2, block
sizes 16 and 64, split decode included); decode against the engine's C++ decode op; a row's bits
alone vs in a batch, and a prompt in one chunk vs two; bad input refused before launch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from crescent.kernels.cpu import paged_attention as cpu_paged_attention
from crescent.kernels.paged import paged_attention_reference, paged_decode_attention, paged_prefill_attention
from tests.kernels.helpers import rel_rms

pytestmark = pytest.mark.usefixtures("nan_outputs")
LAYERS, LAYER, D = 3, 1, 64
FP32_TOL, BF16_TOL = 1e-5, 1e-2


class Pool:
    """An engine-shaped pool whose layer LAYER holds each sequence's K/V; tables padded with a
    NaN page (entries past a sequence's length must never be read)."""

    def __init__(self, lengths, *, page, kv, dtype=torch.float32, device="cpu", dim=D):
        pages_per_seq = [-(-n // page) for n in lengths]
        total = sum(pages_per_seq) + 2
        self.pool = torch.full((total, LAYERS, 2, page, kv, dim), float("nan"), dtype=dtype)
        order = torch.randperm(total).tolist()
        self.nan_page = order.pop()
        self.tables = torch.full((len(lengths), max(pages_per_seq)), self.nan_page, dtype=torch.int32)
        for i, (n, p) in enumerate(zip(lengths, pages_per_seq)):
            self.tables[i, :p] = torch.tensor([order.pop() for _ in range(p)])
            pos = torch.arange(n)
            rows = self.tables[i, pos // page].long()
            self.pool[rows, LAYER, :, pos % page] = torch.randn(n, 2, kv, dim).to(dtype)  # (tokens, K/V, KV, D)
        self.pool = self.pool.to(device)
        self.tables = self.tables.to(device)
        self.lens = torch.tensor(lengths, dtype=torch.int64, device=device)

    def to(self, device) -> "Pool":
        """The same pool, tables and lengths on ``device`` (views keep the engine's strides)."""
        moved = copy.copy(self)
        moved.pool, moved.tables, moved.lens = (x.to(device) for x in (self.pool, self.tables, self.lens))
        return moved

    @property
    def k(self):
        return self.pool[:, LAYER, 0]  # (pages, page, KV, D), page stride spanning all layers

    @property
    def v(self):
        return self.pool[:, LAYER, 1]


def scale():
    return 1 / math.sqrt(D)


def test_the_oracle_agrees_with_the_engines_cpu_path():
    lengths, new = [70, 5, 128], [6, 5, 1]
    pool = Pool(lengths, page=64, kv=3)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    q = torch.randn(cu[-1].item(), 9, D)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    for i, n in enumerate(lengths):
        table = pool.tables[i, : -(-n // 64)].long()
        got = cpu_paged_attention(q[cu[i]:cu[i + 1]], pool.k[table].contiguous(), pool.v[table].contiguous(), n,
                                  scale())
        assert rel_rms(got, expected[cu[i]:cu[i + 1]]) < FP32_TOL


@pytest.mark.parametrize("heads,kv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("page", [16, 64])
def test_decode_matches_the_oracle(device, heads, kv, page):
    lengths = [1, page - 1, page, page + 1, 3 * page + 7]  # partial, exactly full and one-over last pages
    pool = Pool(lengths, page=page, kv=kv, device=device)
    q = torch.randn(len(lengths), heads, D, device=device)
    out = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    cu = torch.arange(len(lengths) + 1)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    assert rel_rms(out, expected) < FP32_TOL


@pytest.mark.parametrize("heads,kv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("page", [16, 64])
def test_varlen_prefill_matches_the_oracle(device, heads, kv, page):
    cached, new = [0, 5, 2 * page, 0], [40, 1, 37, 3]  # fresh prompts, a decode row, chunks on cached prefixes
    lengths = [c + n for c, n in zip(cached, new)]
    pool = Pool(lengths, page=page, kv=kv, device=device)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=device)
    q = torch.randn(sum(new), heads, D, device=device)
    out = paged_prefill_attention(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    assert rel_rms(out, expected) < FP32_TOL


def test_a_head_dim_that_is_not_a_power_of_two(device):
    cached, new = [0, 20], [30, 1]
    pool = Pool([30, 21], page=16, kv=2, device=device, dim=48)
    cu = torch.tensor([0, 30, 31], device=device)
    q = torch.randn(31, 4, 48, device=device)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=0.1)
    assert rel_rms(paged_prefill_attention(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=0.1), expected) < FP32_TOL
    decode = paged_decode_attention(q[29:], pool.k, pool.v, pool.tables, pool.lens, scale=0.1)
    assert rel_rms(decode[1], expected[30]) < FP32_TOL and sum(cached) + sum(new) == 51


def test_bf16_pools(device):
    lengths = [1, 33, 100]
    pool = Pool(lengths, page=16, kv=3, dtype=torch.bfloat16, device=device)
    q = torch.randn(3, 9, D, device=device).bfloat16()
    cu = torch.arange(4, device=device)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    out = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    assert out.dtype == torch.bfloat16 and rel_rms(out, expected) < BF16_TOL
    new = [1, 20, 36]
    cu = torch.tensor([0, 1, 21, 57], device=device)
    qp = torch.randn(57, 9, D, device=device).bfloat16()
    expected = paged_attention_reference(qp, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    out = paged_prefill_attention(qp, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    assert rel_rms(out, expected) < BF16_TOL and sum(new) == 57


def test_bf16_pools_with_the_engines_64_token_pages(device):
    """The engine's default block size in bf16: 64-key tiles (one page a step), partial, exactly
    full and one-over last pages, a row past DECODE_SPLIT (split decode merged in order), and
    prefill chunks that start inside a page and cross into the next."""
    lengths = [1, 63, 64, 65, 600]  # 600 > 512 keys: the table reaches past one decode piece
    pool = Pool(lengths, page=64, kv=3, dtype=torch.bfloat16, device=device)
    q = torch.randn(len(lengths), 9, D, device=device).bfloat16()
    cu = torch.arange(len(lengths) + 1, device=device)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    out = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lengths):  # per row, so one bad row cannot hide in the batch's mean
        assert rel_rms(out[i], expected[i]) < BF16_TOL, f"decode row of {n} tokens"
    # a 1-token prompt, a chunk from slot 23, a decode row in a last slot, a 65-token prompt, a
    # chunk from slot 18 of page 8 into page 9
    new = [1, 40, 1, 65, 70]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device=device)
    qp = torch.randn(sum(new), 9, D, device=device).bfloat16()
    expected = paged_attention_reference(qp, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    out = paged_prefill_attention(qp, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lengths):
        assert rel_rms(out[cu[i]:cu[i + 1]], expected[cu[i]:cu[i + 1]]) < BF16_TOL, f"prefill of {n} tokens"


def test_decode_agrees_with_the_engines_cpp_decode_op(device):
    """The C++ op is what the engine runs for decode rows on a CPU: same pool views, same answer
    (the op reads host memory; the Triton kernel gets a copy on the test's device)."""
    from crescent.kernels.cpu.cpu_ext import paged_decode_ops

    ops = paged_decode_ops()
    if ops is None:
        pytest.skip("the C++ decode op could not be built here (no compiler)")
    lengths = [1, 64, 65, 200]
    pool = Pool(lengths, page=64, kv=3)
    q = torch.randn(4, 9, D)
    expected = ops.paged_decode_attention(q, pool.k, pool.v, pool.tables.long(), pool.lens, scale())
    on = pool.to(device)
    actual = paged_decode_attention(q.to(device), on.k, on.v, on.tables, on.lens, scale=scale())
    assert rel_rms(actual, expected) < FP32_TOL


def test_a_decode_row_has_the_same_bits_alone_and_in_a_batch(device):
    lengths = [90, 3, 64, 17]
    pool = Pool(lengths, page=16, kv=3, device=device)
    q = torch.randn(4, 9, D, device=device)
    batched = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    for i in range(4):
        alone = paged_decode_attention(q[i:i + 1], pool.k, pool.v, pool.tables[i:i + 1], pool.lens[i:i + 1],
                                       scale=scale())
        assert torch.equal(alone[0], batched[i])


def test_a_prompt_in_two_chunks_gives_the_bits_of_one_chunk(device):
    """Chunked prefill (33 tokens, then 37 on the cached 33) equals the whole prompt at once,
    and a sequence's rows do not change when another sequence shares the launch."""
    pool = Pool([70, 50], page=16, kv=3, device=device)
    q = torch.randn(70, 9, D, device=device)
    one = paged_prefill_attention(q, pool.k, pool.v, pool.tables[:1], pool.lens[:1],
                                  torch.tensor([0, 70], device=device), scale=scale())
    first = paged_prefill_attention(q[:33], pool.k, pool.v, pool.tables[:1], torch.tensor([33], device=device),
                                    torch.tensor([0, 33], device=device), scale=scale())
    other = torch.randn(50, 9, D, device=device)
    both = paged_prefill_attention(torch.cat([other, q[33:]]), pool.k, pool.v, pool.tables.flip(0),
                                   pool.lens.flip(0), torch.tensor([0, 50, 87], device=device), scale=scale())
    assert torch.equal(first, one[:33])
    assert torch.equal(both[50:], one[33:])


def test_bad_input_is_refused_before_launch(device):
    pool = Pool([5], page=16, kv=3, device=device)
    q = torch.randn(1, 9, D, device=device)
    with pytest.raises(ValueError, match="H % KV"):
        paged_decode_attention(torch.randn(1, 8, D, device=device), pool.k, pool.v, pool.tables, pool.lens,
                               scale=1.0)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(torch.randn(2, 9, D, device=device), pool.k, pool.v, pool.tables, pool.lens,
                               scale=1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        odd = torch.zeros(2, 24, 3, D, device=device)
        paged_decode_attention(q, odd, odd, pool.tables, pool.lens, scale=1.0)
    with pytest.raises(ValueError, match="cu_q"):
        paged_prefill_attention(q, pool.k, pool.v, pool.tables, pool.lens, torch.tensor([0], device=device),
                                scale=1.0)


@pytest.mark.parametrize("page", [16, 64])
def test_long_decode_rows_split_and_merge_to_the_oracle_and_the_same_bits(device, monkeypatch, page):
    """With DECODE_SPLIT at 64 keys, rows of 1..4 pieces: the oracle's answer; a row's bits alone,
    in a batch, and (one piece) on the unsplit kernel are the same."""
    import crescent.kernels.paged as paged

    lengths = [1, 64, 65, 200, 40]
    pool = Pool(lengths, page=page, kv=3, device=device)
    q = torch.randn(len(lengths), 9, D, device=device)
    unsplit = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    monkeypatch.setattr(paged, "DECODE_SPLIT", 64)
    split = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens, scale=scale())
    cu = torch.arange(len(lengths) + 1, device=device)
    expected = paged_attention_reference(q, pool.k, pool.v, pool.tables, pool.lens, cu, scale=scale())
    assert rel_rms(split, expected) < FP32_TOL
    for i in (0, 1, 4):  # one piece each: the unsplit kernel's bits
        assert torch.equal(split[i], unsplit[i])
    for i in (2, 3):  # several pieces: alone (a table of its own width) as in the batch
        alone = paged_decode_attention(q[i:i + 1], pool.k, pool.v, pool.tables[i:i + 1], pool.lens[i:i + 1],
                                       scale=scale())
        assert torch.equal(alone[0], split[i])
