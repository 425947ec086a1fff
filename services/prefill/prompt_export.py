"""A prompt's KV copied out of the paged cache once, for both of its readers.

After a prompt is computed, prefill needs its KV twice: the new full blocks go to the kvstore
(in the background) and every block, the last possibly partial, goes to decode in the handoff.
Both read through one ``PromptExport``: a block is copied out of the cache the first time
either asks for it, and the other gets the same buffer — the kvstore's ``KvBlock`` payload and
the handoff's message payload are one allocation. Copies run on the engine thread a few blocks
per call, so an aggregated instance's decode steps run in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.runtime import EngineWorker
from crescent.services.kvwire.fused_copy import empty_buffer

EXPORT_BLOCKS_PER_CALL = 4  # KV blocks copied out per engine-thread call


def owned_bytes(tensor: torch.Tensor) -> memoryview:
    """A payload's bytes, read-only: the tensor's own memory when it is a fresh contiguous
    tensor (a partial block or a hybrid model's block is assembled anew), else one copy (a full
    Llama block is a view of the cache, whose page is reused later)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.untyped_storage().nbytes() == nbytes:
        # the array keeps the tensor alive; bytes, as numpy has no bfloat16
        return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B").toreadonly()
    out = empty_buffer(nbytes)
    torch.frombuffer(out, dtype=tensor.dtype).view(tensor.shape).copy_(tensor)
    return out.toreadonly()


class PromptExport:
    """Block payloads of one prompt, each copied out of the cache at most once."""

    def __init__(self, engine: Engine, worker: EngineWorker, seq: Sequence, prompt_tokens: int) -> None:
        self._engine, self._worker, self._seq = engine, worker, seq
        self.prompt_tokens = prompt_tokens
        self._payloads: dict[int, memoryview] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}  # a hybrid model's blocks differ (with or without a state)
        self._lock = asyncio.Lock()  # two readers asking at once: the second waits, then reuses
        self._filling: asyncio.Event | None = None  # a layer-wise handoff copying blocks meanwhile
        self.copied_bytes = 0

    @property
    def num_blocks(self) -> int:
        return -(-self.prompt_tokens // self._engine.block_size)

    def tokens_in(self, index: int) -> int:
        """Tokens of block ``index`` (the last one may be partial)."""
        return min(self._engine.block_size, self.prompt_tokens - index * self._engine.block_size)

    def shape(self, index: int) -> tuple[int, ...]:
        """The tensor shape of block ``index``'s payload (copied already)."""
        return self._shapes[index]

    def filled_by(self, done: asyncio.Event) -> None:
        """Blocks are being copied out by someone else (a layer-wise handoff, which ``adopt``s
        them): readers wait for ``done``, then copy only what is still missing."""
        self._filling = done

    def adopt(self, index: int, payload: memoryview, shape: tuple[int, ...]) -> None:
        """Block ``index``'s payload, copied out by the layer-wise handoff."""
        self._payloads[index], self._shapes[index] = payload, shape
        self.copied_bytes += len(payload)

    async def payloads(self, indices: Iterable[int]) -> list[memoryview]:
        """The payloads of blocks ``indices``, copied now where no reader asked before."""
        wanted = list(indices)
        if self._filling is not None:
            await self._filling.wait()
        async with self._lock:
            missing = [i for i in wanted if i not in self._payloads]
            for start in range(0, len(missing), EXPORT_BLOCKS_PER_CALL):
                batch = missing[start : start + EXPORT_BLOCKS_PER_CALL]
                for i, (payload, shape) in zip(batch, await self._worker.run(self._copy, batch)):
                    self._payloads[i], self._shapes[i] = payload, shape
                    self.copied_bytes += len(payload)
        return [self._payloads[i] for i in wanted]

    def _copy(self, indices: list[int]) -> list[tuple[memoryview, tuple[int, ...]]]:  # on the engine thread
        tensors = [self._engine.block_payload(self._seq, i, self.tokens_in(i)) for i in indices]
        return [(owned_bytes(t), tuple(t.shape)) for t in tensors]
