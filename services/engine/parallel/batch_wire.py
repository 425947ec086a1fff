"""A ``ForwardBatch`` as one int64 tensor, for the leader to broadcast to its workers.

Layout: the four per-token columns (token ids, positions, slot pages, slot offsets), then per
chunk (context_len, num_new, pages in its table), then every chunk's page table back to back.
Plain integers, no pickle: a worker rebuilds the batch exactly.
"""

from __future__ import annotations

import torch

from crescent.services.engine.llama import ForwardBatch, SeqChunk


def encode_batch(batch: ForwardBatch) -> torch.Tensor:
    chunks = torch.tensor([[c.context_len, c.num_new, len(c.pages)] for c in batch.chunks], dtype=torch.int64)
    pages = torch.tensor([p for c in batch.chunks for p in c.pages], dtype=torch.int64)
    head = torch.tensor([batch.token_ids.numel(), len(batch.chunks)], dtype=torch.int64)
    return torch.cat([head, batch.token_ids, batch.positions, batch.slot_pages.to(torch.int64),
                      batch.slot_offsets.to(torch.int64), chunks.view(-1), pages])


def decode_batch(flat: torch.Tensor) -> ForwardBatch:
    tokens, num_chunks = int(flat[0]), int(flat[1])
    at = 2
    columns = []
    for _ in range(4):
        columns.append(flat[at : at + tokens].clone())
        at += tokens
    shape = flat[at : at + 3 * num_chunks].view(num_chunks, 3).tolist()
    at += 3 * num_chunks
    chunks = []
    for context_len, num_new, num_pages in shape:
        chunks.append(SeqChunk(tuple(flat[at : at + num_pages].tolist()), context_len, num_new))
        at += num_pages
    if at != flat.numel():
        raise ValueError(f"a forward batch of {flat.numel()} integers, {at} expected")
    return ForwardBatch(token_ids=columns[0], positions=columns[1], slot_pages=columns[2], slot_offsets=columns[3],
                        chunks=tuple(chunks))
