"""KDA recurrent states of a hybrid cache: the live state of a running sequence, and the prefix
cache's bounded pool of state snapshots with its policy and LRU eviction.

A state is what the KDA layers carry from one token to the next: per KDA layer the ``[HV, K, V]``
delta-rule state (always fp32: the kernels accumulate in it) and the last ``W - 1`` inputs of the
q/k/v short convolutions (the cache dtype). A running sequence owns exactly one (``KdaStates``
with one row). The prefix cache keeps copies of it — *snapshots* — only at some block
boundaries (``SnapshotPolicy``), in a fixed pool of slots (``SnapshotPool``): when the pool is
full, the least recently used snapshot goes. A cached block without a snapshot still holds its
latents; a prefix hit resumes from the last snapshot at or below the match and recomputes the
rest (vLLM's and SGLang's hybrid caches do the same with their Mamba states).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from crescent.services.engine.kimi_k3.config import DEFAULT_SNAPSHOT_EVERY_BLOCKS, DEFAULT_SNAPSHOT_SLOTS, K3Config


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    """Which block boundaries of a prompt keep a state snapshot, and how many snapshots the pool holds.

    ``every_blocks`` = k: the end of every k-th block (k = 1: every block; 0: none of these).
    Always: the end of the prompt's last full block — where the next turn of a conversation,
    whose prompt extends this one, resumes — and, when the prompt fills its last block exactly,
    the block before it (a resubmitted prompt recomputes at least its last token)."""

    every_blocks: int = DEFAULT_SNAPSHOT_EVERY_BLOCKS
    slots: int = DEFAULT_SNAPSHOT_SLOTS

    def __post_init__(self) -> None:
        if self.every_blocks < 0 or self.slots < 0:
            raise ValueError(f"snapshot policy needs every_blocks >= 0 and slots >= 0, got {self}")

    def wants(self, block: int, prompt_tokens: int, block_size: int) -> bool:
        """Whether the state at the end of block ``block`` of a prompt of ``prompt_tokens`` is kept."""
        full = prompt_tokens // block_size
        if not self.slots or block >= full:
            return False
        if self.every_blocks and (block + 1) % self.every_blocks == 0:
            return True
        return block in (full - 1, (prompt_tokens - 1) // block_size - 1)


class KdaStates:
    """``count`` KDA states, all KDA layers: ``state[i, j]`` ``[HV, K, V]`` fp32 and
    ``tail[i, j]`` ``[conv_dim, W - 1]`` in ``dtype``. ``floats`` is one state's size on the wire."""

    def __init__(self, cfg: K3Config, count: int, dtype: torch.dtype, device: torch.device | str) -> None:
        n_kda = len(cfg.kda_layers)
        self.state = torch.zeros((count, n_kda, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim),
                                 dtype=torch.float32, device=device)
        self.tail = torch.zeros((count, n_kda, cfg.kda_conv_dim, cfg.kda_conv_width - 1), dtype=dtype, device=device)

    @staticmethod
    def wire_floats(cfg: K3Config) -> int:
        n_kda = len(cfg.kda_layers)
        return n_kda * (cfg.kda_num_v_heads * cfg.kda_head_dim * cfg.kda_v_head_dim
                        + cfg.kda_conv_dim * (cfg.kda_conv_width - 1))

    @classmethod
    def over(cls, state: torch.Tensor, tail: torch.Tensor) -> KdaStates:
        """States that are views of other tensors (a ``LiveStatePool`` row): writes go through."""
        states = cls.__new__(cls)
        states.state, states.tail = state, tail
        return states

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.state, self.tail))

    def read(self, i: int) -> torch.Tensor:
        """State ``i`` as one flat fp32 tensor: the recurrent states, then the conv tails (exact: a
        bf16 tail widens to fp32 without loss)."""
        return torch.cat([self.state[i].reshape(-1), self.tail[i].reshape(-1).float()])

    def write(self, i: int, flat: torch.Tensor) -> None:
        n = self.state[i].numel()
        self.state[i].copy_(flat[:n].view_as(self.state[i]))
        self.tail[i].copy_(flat[n:].view_as(self.tail[i]))

    def copy(self, dst: int, src: KdaStates, i: int) -> None:
        self.state[dst].copy_(src.state[i])
        self.tail[dst].copy_(src.tail[i])


class SnapshotPool:
    """A fixed pool of snapshot slots, each holding the state at the end of one cached page.

    A page has at most one snapshot. ``take`` gives a page a slot, evicting the least recently
    used snapshot when none is free; ``touch`` marks one used (a prefix hit resumed from it);
    ``drop`` frees a page's snapshot (its page was reused or left the prefix map)."""

    def __init__(self, cfg: K3Config, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.states = KdaStates(cfg, slots, dtype, device)
        self.slots = slots
        self._slot_of: dict[int, int] = {}
        self._lru: OrderedDict[int, int] = OrderedDict()  # page -> slot, least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self.taken = 0      # snapshots written, for the stats
        self.evicted = 0    # snapshots evicted to make room

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, page: int) -> int | None:
        return self._slot_of.get(page)

    def touch(self, page: int) -> None:
        if page in self._lru:
            self._lru.move_to_end(page)

    def take(self, page: int) -> int | None:
        """A slot for ``page``'s snapshot (its old one, if any, is replaced); None with no slots at all."""
        self.drop(page)
        if not self._free:
            if not self._lru:
                return None
            old, slot = self._lru.popitem(last=False)
            del self._slot_of[old]
            self._free.append(slot)
            self.evicted += 1
        slot = self._free.pop()
        self._slot_of[page] = slot
        self._lru[page] = slot
        self.taken += 1
        return slot

    def drop(self, page: int) -> None:
        slot = self._slot_of.pop(page, None)
        if slot is not None:
            del self._lru[page]
            self._free.append(slot)


class LiveStatePool:
    """The live states of the running sequences, one row each, in one tensor per KDA layer:
    ``state[j]`` ``[rows, HV, K, V]`` fp32 — the pool ``kda_decode``'s ``state_indices`` updates in
    place, so a batched decode step gathers and scatters no recurrent state — and ``tail[j]``
    ``[rows, conv_dim, W - 1]`` fp32. A row is zeroed when taken and reused once given back.

    The pool grows to the peak of running sequences, one row at a time (so its bytes are one
    live state per sequence at that peak, as before it was pooled), copying the rows it holds;
    it never shrinks. ``row(r)`` is a ``KdaStates`` view of row r (row 0 of it), valid until the
    pool next grows (between forwards: the cache takes rows when the engine opens a state)."""

    def __init__(self, cfg: K3Config, device: torch.device | str) -> None:
        n_kda = len(cfg.kda_layers)
        self._shape = ((n_kda, 0, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim),
                       (n_kda, 0, cfg.kda_conv_dim, cfg.kda_conv_width - 1))
        self.device = device
        self.state = torch.zeros(self._shape[0], dtype=torch.float32, device=device)
        self.tail = torch.zeros(self._shape[1], dtype=torch.float32, device=device)
        self._free: list[int] = []

    @property
    def rows(self) -> int:
        return self.state.shape[1]

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.state, self.tail))

    def take(self) -> int:
        if not self._free:
            self._grow(self.rows + 1)
        r = self._free.pop()
        self.state[:, r].zero_()
        self.tail[:, r].zero_()
        return r

    def give(self, r: int) -> None:
        self._free.append(r)

    def row(self, r: int) -> KdaStates:
        return KdaStates.over(self.state[:, r : r + 1].transpose(0, 1), self.tail[:, r : r + 1].transpose(0, 1))

    def _grow(self, rows: int) -> None:
        old = self.rows
        grown = []
        for tensor, shape in zip((self.state, self.tail), self._shape):
            new = torch.empty((shape[0], rows, *shape[2:]), dtype=torch.float32, device=self.device)
            new[:, :old].copy_(tensor)
            grown.append(new)
        self.state, self.tail = grown
        self._free.extend(range(rows - 1, old - 1, -1))
