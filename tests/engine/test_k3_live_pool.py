"""Kimi K3's live KDA states in one pool (``snapshots.LiveStatePool``): a batched decode step reads
and writes each sequence's recurrent state in its pool row (the Triton kernel through
``state_indices``, in place), with no per-sequence gather and scatter.

What a user would notice: a sequence decodes the same tokens whether it runs alone or beside
sequences that join (the pool grows under it) and leave (their rows are reused, zeroed).
The Triton path on the pool is compared with the reference in
``test_kimi_k3_device_path.py::test_triton_path_matches_the_cpu_reference`` (interpreter)."""

from __future__ import annotations

import torch

from tests.engine.test_kimi_k3_snapshots import make_engine, prompt, rel_err


def greedy(engine, seqs, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:  # noqa: ANN001
    """``steps`` batched greedy decode steps: (each sequence's new tokens, each step's logits)."""
    tokens, rows = [[] for _ in seqs], []
    for _ in range(steps):
        logits = engine.decode_step(seqs)
        rows.append(logits)
        for i, seq in enumerate(seqs):
            tokens[i].append(int(torch.argmax(logits[i])))
            seq.token_ids.append(tokens[i][-1])
    return tokens, rows


def start(engine, seq_id: str, tokens: list[int]):  # noqa: ANN001, ANN201
    """Add and prefill a sequence, its first token appended: (the sequence, that token)."""
    seq = engine.add_sequence(seq_id, tokens, use_cache=False)
    first = int(torch.argmax(engine.prefill(seq)[0]))
    seq.token_ids.append(first)
    return seq, first


def alone(tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    engine = make_engine()
    seq, first = start(engine, "alone", tokens)
    out, rows = greedy(engine, [seq], steps)
    return [first, *out[0]], torch.stack([r[0] for r in rows])


def column(rows: list[torch.Tensor], i: int) -> torch.Tensor:
    return torch.stack([r[i] for r in rows])


def test_a_sequence_decodes_the_same_alone_and_while_others_join_and_leave_the_pool() -> None:
    engine = make_engine()
    cache = engine.cache
    a_tokens, b_tokens, c_tokens, d_tokens = (prompt(n, seed=i) for i, n in enumerate((21, 35, 9, 17)))
    a, a_first = start(engine, "a", a_tokens)
    early, early_rows = greedy(engine, [a], 2)
    assert cache.live_pool.rows == 1
    (b, b_first), (c, _) = start(engine, "b", b_tokens), start(engine, "c", c_tokens)  # the pool grows under a
    assert cache.live_pool.rows == 3 and cache.running_states == 3
    late, rows = greedy(engine, [a, b, c], 4)
    want, want_rows = alone(a_tokens, 6)
    assert [a_first, *early[0], *late[0]] == want
    assert rel_err(torch.cat([column(early_rows, 0), column(rows, 0)]), want_rows) < 1e-6
    want, want_rows = alone(b_tokens, 4)
    assert [b_first, *late[1]] == want and rel_err(column(rows, 1), want_rows) < 1e-6

    engine.release(b)  # b's row is given back; d takes it, zeroed, and decodes as if alone
    d, d_first = start(engine, "d", d_tokens)
    assert cache.live_pool.rows == 3
    out, rows = greedy(engine, [c, d], 3)
    want, want_rows = alone(d_tokens, 3)
    assert [d_first, *out[1]] == want and rel_err(column(rows, 1), want_rows) < 1e-6
    for s in (a, c, d):
        engine.release(s)
    assert cache.running_states == 0 and cache.live_pool.rows == 3  # kept for the next peak


def test_a_reused_row_starts_from_zeros() -> None:
    cache = make_engine().cache
    a, b = cache.open_state(), cache.open_state()
    cache.live(a).state.fill_(3.0)
    cache.live(a).tail.fill_(2.0)
    cache.close_state(a)
    c = cache.open_state()
    assert cache.live_pool.rows == 2
    assert not cache.live(c).state.any() and not cache.live(c).tail.any()
    cache.close_state(b)
    cache.close_state(c)
