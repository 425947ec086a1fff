"""The paged cache of a kimi_k3 model: MLA latents per token in pages, one KDA state per running
sequence, and a bounded pool of state snapshots for the prefix cache.

- ``latent[m, page, slot]``: layer m's (m-th MLA layer) c_kv and k_rope of one token, in the
  config's ``cache_dtype`` (fp8 e4m3 with a scale: ``to_latent``). Each layer's pages form one contiguous ``[pages, block_size, Dc + Dr]``
  tensor, the layout the Triton MLA kernel reads. Pages hold nothing else.
- Live states (``open_state``): each running sequence owns one row of ``live_pool`` — the KDA
  state after its last computed token, all fp32 (its conv tail too: see ``round_tail``); a
  batched decode step updates the rows in place (``LiveStatePool``). The engine opens it with the sequence, fills it from a snapshot
  (``resume_state``) or a received block (``write_block(..., state=)``), and closes it on release.
- Snapshots (``snapshots.SnapshotPool``): copies of a sequence's state at the end of chosen full
  pages (``SnapshotPolicy``), LRU-evicted from a fixed number of slots; fp32 states, conv tails
  in the cache dtype (exact: a tail is rounded to it at every block boundary). A page leaving the prefix
  map or handed out anew loses its snapshot (``PageManager``'s ``on_reset``).

A prefix hit can only resume where a snapshot is: ``resumable(pages)`` is the length of the
matched pages up to the last one with a snapshot; the engine recomputes the rest.

Block payloads (kvstore, peers, handoff) are tensors of the cache dtype (``wire_dtype``), so
bf16 latents travel as bf16. A block without a state is its latents token-major, shape
``(tokens, mla_layers * (Dc + Dr))``; a block with a state (a snapshot, or the live state of a
sequence's last block in a handoff) is one flat ``(state_elements + tokens * mla_layers * (Dc + Dr),)``
tensor, the state first: the state's fp32 bytes (states stay fp32 on the wire, tails too, so a
live tail is handed off unrounded) reinterpreted as ``state_elements = state_floats * 4 / itemsize``
elements of the cache dtype, then the latents. ``block_shape``, the layout's name, is a full
block without a state.

A layer-wise handoff (``layer_layout``, ``copy_layer``) moves these payloads an MLA layer at a
time: layer m's latents of a block's tokens, placed into the token-major rows above, and the
last block's live state (``copy_live_state``) apart once the last KDA layer made it final.

On a GPU those copies run on the copying thread while the compute thread queues later layers, so
they go through ``device_staging.py`` as the Llama pool's do: the model calls ``layer_written(i)``
before its hook (a fence per model layer on the compute stream), ``copy_layer`` waits for its MLA
layer's fence on a copy stream, and a state (``stage_live_state``, ``stage_snapshot``) is cloned on
the device at the hook and copied to the host later, after a fence of its own: the compute thread
never waits. On the CPU every fence is complete and the copies are the plain ones they were.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from crescent.services.engine.device_staging import DeviceStaging, Staged, streams_for
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.memory import cache_torch_dtype, tail_torch_dtype
from crescent.services.engine.kimi_k3.ops import to_device
from crescent.services.engine.kimi_k3.snapshots import KdaStates, LiveStatePool, SnapshotPolicy, SnapshotPool
from crescent.services.engine.kv_cache import PageManager
from crescent.services.engine.llama import ForwardBatch
from crescent.services.kvwire.layer_wire import LayerLayout


@dataclass(frozen=True, slots=True)
class MlaStep:
    """A forward's paged-attention metadata, built once on the host and moved to the cache's
    device once (not per MLA layer): every layer reads the same pages."""

    slot_pages: torch.Tensor   # [T] page of each new token
    slot_offsets: torch.Tensor  # [T] its slot in that page
    positions: torch.Tensor    # [T] each new token's position (RoPE, when the model uses it)
    block_table: torch.Tensor  # [N, max_pages] int64
    seq_lens: torch.Tensor     # [N] tokens in the cache per sequence, this forward's included
    cu_q: torch.Tensor         # [N + 1] cumulative new tokens

    @staticmethod
    def build(batch: ForwardBatch, block_size: int, device: torch.device | str) -> MlaStep:
        chunks = batch.chunks
        width = max(-(-c.context_len // block_size) for c in chunks)
        table = [list(c.pages[:width]) + [0] * (width - min(width, len(c.pages))) for c in chunks]
        cu_q = [0]
        for c in chunks:
            cu_q.append(cu_q[-1] + c.num_new)
        return MlaStep(to_device(batch.slot_pages, device), to_device(batch.slot_offsets, device),
                       to_device(batch.positions, device),
                       to_device(table, device), to_device([c.context_len for c in chunks], device),
                       to_device(cu_q, device))


@dataclass(slots=True)
class ChunkStates:
    """What one chunk of a forward does with states: it continues ``live`` (row 0; row ``row`` of
    the cache's ``live_pool``) and leaves snapshots at these block boundaries (token position ->
    snapshot slot)."""

    live: KdaStates
    row: int = -1
    snapshots: dict[int, int] = field(default_factory=dict)


class K3Cache:
    def __init__(self, cfg: K3Config, num_pages: int, block_size: int, device: torch.device | str = "cpu",
                 policy: SnapshotPolicy = SnapshotPolicy()) -> None:
        self.cfg, self.block_size, self.policy, self.device = cfg, block_size, policy, device
        self.dtype = cache_torch_dtype(cfg)
        self.tail_dtype = tail_torch_dtype(cfg)
        # fp8 latents are stored divided by a per-cache scale and read back times it (vLLM's MLA
        # fp8 cache: one scale per layer, 1.0 unless calibrated); the attention folds it into its
        # softmax scale and output, so the kernels read the fp8 bytes as they are
        self.latent_scale = 1.0
        self.pages = PageManager(num_pages, on_reset=self._page_reset)
        self._latent_dim = cfg.mla_latent_dim
        self._token_floats = len(cfg.mla_layers) * cfg.mla_latent_dim
        # a state's fp32 floats, counted in elements of the cache dtype (its bytes, reinterpreted)
        self._state_elements = KdaStates.wire_floats(cfg) * 4 // self.dtype.itemsize
        self.latent = torch.zeros((len(cfg.mla_layers), num_pages, block_size, cfg.mla_latent_dim), dtype=self.dtype,
                                  device=device)
        self.snapshots = SnapshotPool(cfg, policy.slots, self.tail_dtype, device)
        # fp32 tails: a running sequence's tail is rounded to the cache dtype only at block
        # boundaries (``round_tail``), never at the end of a forward, so how a prompt is cut into
        # forwards (chunked prefill, batching, decode steps, a handoff) changes no value
        self.live_pool = LiveStatePool(cfg, device)
        self._rows: dict[int, int] = {}  # live state handle -> its pool row
        self._handles = itertools.count()
        self.step: list[ChunkStates] = []  # the current forward's plan (``plan_forward``)
        self.mla_step: MlaStep | None = None  # the current forward's MLA metadata (``plan_forward``)
        # fences per model layer (KDA layers' too: the states' copies wait for the last one's)
        self.staging = DeviceStaging(cfg.num_layers, streams_for(torch.device(device)))

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of block payloads (``read_block``/``write_block``): the cache's."""
        return self.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.payload_shape(self.block_size, with_state=False)

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.block_size

    @property
    def running_states(self) -> int:
        return len(self._rows)

    def page_bytes(self) -> int:
        """Cache bytes of one page (latents only: states are per sequence and per snapshot)."""
        return self.latent[:, 0].numel() * self.latent.element_size()

    def nbytes(self) -> int:
        """Bytes allocated now: pages, the snapshot pool and the live states' pool (one state per
        sequence at the peak of running sequences)."""
        return self.latent.untyped_storage().nbytes() + self.snapshots.states.nbytes() + self.live_pool.nbytes()

    def payload_shape(self, num_tokens: int, *, with_state: bool = True) -> tuple[int, ...]:
        if with_state:
            return (self._state_elements + num_tokens * self._token_floats,)
        return (num_tokens, self._token_floats)

    def payload_tokens(self, shape: Sequence[int]) -> int:
        shape = tuple(shape)
        if len(shape) == 2:
            tokens = shape[0]
        elif len(shape) == 1:
            tokens = (shape[0] - self._state_elements) // max(self._token_floats, 1)
        else:
            tokens = -1
        if not 0 < tokens <= self.block_size or self.payload_shape(tokens, with_state=len(shape) == 1) != shape:
            raise ValueError(f"K3 block payload shape {shape} fits neither {self.block_shape} (latents) nor "
                             f"{self.payload_shape(self.block_size)} (latents and a state) or a prefix of them")
        return tokens

    @staticmethod
    def payload_has_state(shape: Sequence[int]) -> bool:
        return len(shape) == 1

    # ---- blocks --------------------------------------------------------------------------------

    def read_block(self, page: int, num_tokens: int | None = None, *, state: int | None = None) -> torch.Tensor:
        """The page's first ``num_tokens`` latents, with the live state ``state`` if given, else with
        the page's snapshot if it has one."""
        n = self.block_size if num_tokens is None else num_tokens
        latents = torch.empty((n, self.latent.shape[0], self._latent_dim), dtype=self.dtype, device=self.device)
        latents.copy_(self.latent[:, page, :n].transpose(0, 1))  # a copy of its own: the page is reused later
        if state is not None:
            carried = self.live(state).read(0)
        else:
            slot = self.snapshots.slot(page) if n == self.block_size else None
            if slot is None:
                return latents.view(n, -1)
            carried = self.snapshots.states.read(slot)
        return torch.cat([carried.view(self.dtype), latents.view(-1)])

    def write_block(self, page: int, payload: torch.Tensor, *, state: int | None = None, snapshot: bool = True) -> None:
        """Copy a (possibly partial) block payload into ``page``. A state in it goes to the live
        state ``state`` if given, and (``snapshot``, full blocks) becomes the page's snapshot."""
        if payload.dtype != self.dtype:
            raise ValueError(f"K3 block payload of dtype {payload.dtype}, the cache's is {self.dtype}")
        tokens = self.payload_tokens(payload.shape)
        flat = payload.reshape(-1)
        if self.payload_has_state(payload.shape):
            carried, flat = flat[: self._state_elements].view(torch.float32), flat[self._state_elements :]
            if state is not None:
                self.live(state).write(0, carried)
            slot = self.snapshots.take(page) if snapshot and tokens == self.block_size else None
            if slot is not None:
                self.snapshots.states.write(slot, carried)
        elif state is not None:
            raise ValueError("a block that hands a sequence its state must carry one")
        latents = flat.view(tokens, -1, self._latent_dim)
        self.latent[:, page, :tokens].copy_(latents.transpose(0, 1))

    # ---- a layer at a time (a layer-wise handoff: kvwire/layer_wire.py) -----------------------

    def layer_layout(self) -> LayerLayout:
        """The wire's layers are the MLA layers, token after token in a payload (``block_shape``),
        after a block's state. The model's ``on_layer`` names every layer: a KDA layer completes
        no wire layer, and the last KDA layer makes the forward's states final."""
        wire = {layer: m for m, layer in enumerate(self.cfg.mla_layers)}
        kda = self.cfg.kda_layers
        return LayerLayout(len(self.cfg.mla_layers), self._latent_dim * self.dtype.itemsize,
                           tuple(wire.get(i) for i in range(self.cfg.num_layers)), token_major=True,
                           state_bytes=self._state_elements * self.dtype.itemsize,
                           states_after=kda[-1] if kda else None)

    def layer_written(self, layer: int) -> None:
        """Model layer ``layer``'s writes of this forward (latents, or states and snapshots) are
        queued: a fence for the copies its hook starts (compute thread; never waits)."""
        self.staging.record(layer)

    def copy_layer(self, page: int, layer: int, num_tokens: int, out: memoryview) -> None:
        """Copy MLA layer ``layer``'s latents of the page's first ``num_tokens`` tokens into ``out``
        (``num_tokens`` rows of ``Dc + Dr``), once that layer's kernels are done (its fence). Another
        thread may compute later layers meanwhile: a finished layer's latents of a held page are
        not written again."""
        dst = torch.frombuffer(out, dtype=self.dtype).view(num_tokens, self._latent_dim)
        self.staging.copy_out(self.cfg.mla_layers[layer], self.latent[layer, page, :num_tokens], dst)

    def stage_live_state(self, handle: int) -> Staged:
        """The live state ``handle`` as a payload carries it (its fp32 bytes), cloned on the device
        now (the hook of the last KDA layer, compute thread): ``copy_into`` a host buffer later."""
        return self.staging.stage(self.live(handle).read(0))

    def stage_snapshot(self, page: int) -> Staged:
        """``page``'s snapshot as its payload carries it, like ``stage_live_state``."""
        slot = self.snapshots.slot(page)
        assert slot is not None, f"page {page} has no state snapshot"
        return self.staging.stage(self.snapshots.states.read(slot))

    def copy_live_state(self, handle: int, out: memoryview) -> None:
        """Copy the live state ``handle`` as a payload carries it (its fp32 bytes) into ``out`` now
        (on a GPU the caller waits for the device: the exporters stage it instead)."""
        self.stage_live_state(handle).copy_into(out)

    def has_snapshot(self, page: int) -> bool:
        """Whether ``page`` keeps a state snapshot (its payload carries it: ``read_block``)."""
        return self.snapshots.slot(page) is not None

    def copy_snapshot(self, page: int, out: memoryview) -> None:
        """Copy ``page``'s snapshot as its payload carries it (fp32 bytes, ``read_block``) into ``out`` now."""
        self.stage_snapshot(page).copy_into(out)

    # ---- sequence states -----------------------------------------------------------------------

    def open_state(self) -> int:
        """A new sequence's live state (zeros: before its first token); returns its handle."""
        handle = next(self._handles)
        self._rows[handle] = self.live_pool.take()
        return handle

    def close_state(self, handle: int) -> None:
        self.live_pool.give(self._rows.pop(handle))

    def copy_state(self, src: int, dst: int) -> None:
        self.live(dst).copy(0, self.live(src), 0)

    def live(self, handle: int) -> KdaStates:
        """The live state ``handle`` (row 0 of it), a view of its pool row until a state is next opened."""
        return self.live_pool.row(self._rows[handle])

    def resumable(self, pages: Sequence[int]) -> int:
        """How many of these matched prefix pages a sequence can resume after: up to the last one
        with a snapshot."""
        for i in range(len(pages), 0, -1):
            if self.snapshots.slot(pages[i - 1]) is not None:
                return i
        return 0

    def resume_state(self, handle: int, page: int) -> None:
        """Load the snapshot at the end of ``page`` into the live state ``handle``."""
        slot = self.snapshots.slot(page)
        assert slot is not None, f"page {page} has no state snapshot"
        self.snapshots.touch(page)
        self.live(handle).copy(0, self.snapshots.states, slot)

    # ---- a forward pass ------------------------------------------------------------------------

    def plan_forward(self, batch: ForwardBatch) -> list[ChunkStates]:
        """Per chunk: its live state and the snapshot slots its block boundaries fill (the
        policy's, for blocks of the sequence's cacheable prompt). Kept in ``step`` for the layers."""
        ps, plan = self.block_size, []
        writer: dict[int, tuple[ChunkStates, int]] = {}  # slot -> who fills it in this forward
        for chunk in batch.chunks:
            if chunk.state < 0:
                raise ValueError("a kimi_k3 forward needs every sequence's live state (SeqChunk.state)")
            states = ChunkStates(self.live(chunk.state), self._rows[chunk.state])
            first = chunk.context_len - chunk.num_new
            for end in range((first // ps + 1) * ps, chunk.context_len + 1, ps):
                if self.policy.wants(end // ps - 1, chunk.prompt_tokens, ps):
                    slot = self.snapshots.take(chunk.pages[end // ps - 1])
                    if slot is None:
                        continue
                    if slot in writer:  # a pool smaller than this forward's snapshots: the last one keeps it
                        earlier, position = writer[slot]
                        del earlier.snapshots[position]
                    states.snapshots[end] = slot
                    writer[slot] = (states, end)
            plan.append(states)
        self.step = plan
        self.mla_step = MlaStep.build(batch, ps, self.device) if self.cfg.mla_layers and batch.chunks else None
        return plan

    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``[T, Dc + Dr]`` as the cache stores them: in its dtype; fp8 divided by the
        scale and saturated to e4m3's range (a plain cast would give NaN past ±448)."""
        if self.dtype.itemsize != 1:
            return x.to(self.dtype)
        limit = torch.finfo(self.dtype).max
        return (x.float() / self.latent_scale).clamp(-limit, limit).to(self.dtype)

    def round_tail(self, tail: torch.Tensor) -> torch.Tensor:
        """A conv tail as the cache keeps it: rounded to the cache dtype at every block boundary,
        snapshot or not, so a resumed run and a cold one carry the very same values (and nowhere
        else: the conv inputs of a token's own block stay fp32)."""
        return tail if self.tail_dtype == torch.float32 else tail.to(self.tail_dtype).float()

    def _page_reset(self, page: int) -> None:
        self.snapshots.drop(page)
