"""The connector's worker side (vLLM's model-runner process): KV into vLLM's blocks from the
kvstore before a step, and out of them into Crescent blocks as each layer finishes.

Loads are pipelined by layer (``layer_loads.py``): ``start_load_kv`` hands the step's blocks to a
loader thread, which fetches them, checks them and writes them into vLLM's cache one layer at a
time, and each attention layer waits for its own layer (``wait_for_layer_load``) while the loader
writes the next. A block the store no longer has, or whose bytes, tokens, layout or dtype do not
match, is never written and is reported as a load error, so vLLM recomputes from there
(``kv_load_failure_policy: recompute``): a bad or missing block is a miss, never wrong output.

A hybrid model's loads (recurrent-state groups beside attention: hybrid_layout.py) are whole
requests loaded in the background: attention blocks and the state snapshot they resume from
are all placed, or the request is reported failed and vLLM recomputes it from its start (vLLM
takes block-level errors only from single-group models). Its snapshots are saved once the
step's forward is done (``wait_for_save``): vLLM's recurrent layers have no per-layer hook. Saves copy a finished layer's rows of the step's
completed prompt blocks into one staging tensor per block as ``save_kv_layer`` is called (on a
GPU, the device-to-host copies overlap the later layers), and queue the blocks for the kvstore
once the step's forward is done.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from typing import TYPE_CHECKING

import torch

from crescent.services.instance.wire import block_tensor
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.hybrid_layout import GroupLayout
from crescent.services.engine_vllm.kv_layout import LayerGeometry, geometry, read_layer, write_layer
from crescent.services.engine_vllm.layer_loads import LayerLoader, LoadBatch
from crescent.services.engine_vllm.state_blocks import StateLayer, read_state, state_bytes, write_state
from crescent.services.engine_vllm.store_link import StoreLink
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock

if TYPE_CHECKING:  # vLLM's base class: this module stays importable (and testable) without vLLM
    from crescent.services.engine_vllm.connector_metadata import CrescentConnectorMetadata, LoadSpec

log = logging.getLogger(__name__)

NULL_BLOCK = 0  # vLLM's placeholder block (its pool's first): a snapshot never lands there
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _layer_order(name: str) -> tuple[int, str]:
    found = _LAYER_INDEX.search(name)
    return (int(found.group(1)) if found else -1, name)


class ConnectorWorker:
    def __init__(self, options: ConnectorOptions, link: StoreLink | None, layout: str, num_blocks: int,
                 groups: GroupLayout | None = None) -> None:
        self.options = options
        self.groups = groups or GroupLayout((0,), (), {})
        self.link = link if self.groups.carried else None  # a layout it cannot carry: passive
        self.layout = layout          # vLLM's attention layout (kv_layout.attention_layout)
        self.num_blocks = num_blocks
        self.layers: list[torch.Tensor] = []      # attention layers, in forward order
        self.layer_index: dict[str, int] = {}
        self.layer_slot: list[int] = []           # each attention layer's group, as an index into block_ids
        self.state_layers: list[StateLayer] = []  # recurrent-state layers, in forward order
        self.state_slot: list[int] = []           # each state layer's group, as an index into state_block_ids
        self.geo: LayerGeometry | None = None
        self._staging: dict[bytes, torch.Tensor] = {}  # block key -> its Crescent payload being filled
        self._load_errors: set[int] = set()
        self._loader = LayerLoader()
        self._batch: LoadBatch | None = None  # this step's loads, placed layer by layer
        self._requests = LayerLoader()        # hybrid loads, one request at a time, across steps
        self._lock = threading.Lock()
        self._recved: set[str] = set()        # hybrid loads done since vLLM last asked ...
        self._failed: set[str] = set()        # ... and those of them that failed
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def register(self, kv_caches: dict[str, StateLayer]) -> None:
        groups = self.groups
        if not groups.carried:  # passive: nothing to load into or save from
            log.info("Crescent connector passive for this model: %s", groups.unsupported)
            return
        names = sorted(kv_caches, key=_layer_order)
        attention = [n for n in names if groups.layer_groups.get(n, groups.attention_groups[0]) in groups.attention_groups]
        states = [n for n in names if groups.layer_groups.get(n) in groups.state_groups]
        self.layer_index = {name: i for i, name in enumerate(attention)}
        self.layers = [kv_caches[name] for name in attention]  # type: ignore[misc]
        self.layer_slot = [groups.attention_groups.index(groups.layer_groups.get(n, groups.attention_groups[0]))
                           for n in attention]
        self.state_layers = [kv_caches[name] for name in states]
        self.state_slot = [groups.state_groups.index(groups.layer_groups[n]) for n in states]
        self.geo = geometry(self.layers, self.layout, self.num_blocks)
        log.info("Crescent connector: %d KV layers, blocks %s (%s); %d recurrent-state layers (%d B a snapshot)%s",
                 len(attention), self.geo.kv_format, self.geo.dtype_name, len(states),
                 state_bytes(self.state_layers) if states else 0,
                 f"; passive: {groups.unsupported}" if groups.unsupported else "")

    # -- loads -------------------------------------------------------------------------------------

    def load(self, meta: CrescentConnectorMetadata) -> None:
        """Start this step's loads (``start_load_kv``); layers are awaited by ``wait_for_layer``."""
        self.finish_loads()  # a batch a step left unawaited (none in vLLM's order) is joined first
        if self.link is None or self.geo is None or not meta.loads:
            return
        for spec in meta.loads:
            if spec.state_key:  # a hybrid request: in the background, reported through transfer_results
                self._requests.start(0, lambda batch, spec=spec: self._place_request(spec))
        if any(not spec.state_key for spec in meta.loads):
            self._batch = self._loader.start(len(self.layers), lambda batch: self._place(meta, batch))

    def _place(self, meta: CrescentConnectorMetadata, batch: LoadBatch) -> None:
        """On the loader thread: fetch and check every block, then write them layer by layer."""
        assert self.link is not None and self.geo is not None
        placed: list[tuple[int, torch.Tensor]] = []
        for spec in meta.loads:
            if spec.state_key:
                continue
            block_ids = spec.block_ids[0]  # block-level errors: single-group models only (vLLM's rule)
            batch.claim(block_ids)  # each is an error until every layer of it is written
            blocks = self.link.get_prefix([BlockKey(k) for k in spec.keys])
            count = 0
            for block, tokens, block_id in zip(blocks, spec.token_ids, block_ids):
                payload = self._payload_of(block, tokens)
                if payload is None:
                    break
                placed.append((block_id, payload))
                count += 1
            if count < len(block_ids):
                log.info("request %s: %d of %d kvstore blocks loaded; vLLM recomputes the rest",
                         spec.request_id, count, len(block_ids))
        for layer, view in enumerate(self.layers):
            for block_id, payload in placed:
                write_layer(self.geo, view, block_id, payload[layer])
            batch.layer_done(layer)
        batch.placed(block_id for block_id, _ in placed)
        self.loaded_blocks += len(placed)

    def _place_request(self, spec: LoadSpec) -> None:
        """On the request loader thread: a hybrid request's blocks and its snapshot, all or nothing."""
        assert self.link is not None and self.geo is not None
        ok = False
        try:
            blocks = self.link.get_prefix([BlockKey(k) for k in spec.keys])
            payloads = [self._payload_of(b, t) for b, t in zip(blocks, spec.token_ids)]
            state = self._state_of(spec) if NULL_BLOCK not in spec.state_block_ids else None
            if len(payloads) == len(spec.keys) and all(p is not None for p in payloads) and state is not None:
                for layer, view in enumerate(self.layers):
                    for i, payload in enumerate(payloads):
                        write_layer(self.geo, view, spec.block_ids[self.layer_slot[layer]][i], payload[layer])
                write_state(self.state_layers, [spec.state_block_ids[slot] for slot in self.state_slot], state)
                self.loaded_blocks += len(payloads)
                ok = True
            else:
                log.info("request %s: its %d kvstore blocks and snapshot did not all load; vLLM recomputes it",
                         spec.request_id, len(spec.keys))
        finally:
            with self._lock:
                self._recved.add(spec.request_id)
                if not ok:
                    self._failed.add(spec.request_id)

    def _state_of(self, spec: LoadSpec) -> torch.Tensor | None:
        assert self.link is not None
        found = self.link.get_prefix([BlockKey(spec.state_key)])
        want = (state_bytes(self.state_layers),)
        if not found or found[0].token_ids != spec.token_ids[-1] or found[0].dtype != "uint8" \
                or tuple(found[0].shape) != want:
            return None
        with warnings.catch_warnings():  # a read-only buffer: write_state copies it into vLLM's cache
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(found[0].payload, dtype=torch.uint8)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """Hybrid loads finished since the last call (failed ones included), and the failed ones."""
        with self._lock:
            done, failed = self._recved, self._failed
            self._recved, self._failed = set(), set()
        return done, failed

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this step's loads have written layer ``layer_name`` (before its attention reads it)."""
        layer = self.layer_index.get(layer_name)
        if self._batch is not None and layer is not None:
            self._batch.wait_layer(layer)

    def finish_loads(self) -> None:
        """Join this step's loads; what was not placed becomes a load error (recomputed)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            self._load_errors.update(batch.join())

    def _payload_of(self, block: KvBlock, tokens: tuple[int, ...]) -> torch.Tensor | None:
        geo = self.geo
        assert geo is not None
        if block.token_ids != tokens:
            log.warning("a kvstore block's tokens differ from its key's prompt: a miss")
            return None
        if tuple(block.shape) != geo.block_shape or block.dtype != geo.dtype_name:
            log.warning("a kvstore block of another layout (%s %s, here %s %s): a miss",
                        block.dtype, block.shape, geo.dtype_name, geo.block_shape)
            return None
        return block_tensor(block, geo.block_shape)  # no copy: write_block copies it into vLLM's blocks

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------------

    def save_layer(self, meta: CrescentConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if self.link is None or self.geo is None or not meta.saves:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        slot = self.layer_slot[layer]
        for spec in meta.saves:
            staging = self._staging.get(spec.key)
            if staging is None:
                staging = self._staging[spec.key] = torch.empty(self.geo.block_shape, dtype=self.geo.dtype)
            read_layer(self.geo, kv_layer, spec.block_ids[slot], staging[layer])

    def finish_saves(self, meta: CrescentConnectorMetadata) -> None:
        if self.link is None or self.geo is None or not (meta.saves or meta.state_saves):
            self._staging.clear()
            return
        blocks = []
        for spec in meta.saves:
            staging = self._staging.get(spec.key)
            if staging is None:
                continue
            payload = memoryview(staging.view(torch.uint8).numpy()).cast("B")
            blocks.append(KvBlock.build(BlockKey(spec.key), BlockKey(spec.parent_key) if spec.parent_key else None,
                                        self.options.model_id, self.geo.dtype_name, self.geo.block_shape,
                                        spec.token_ids, payload))
        self._staging.clear()
        if meta.state_saves and self.state_layers:
            size = state_bytes(self.state_layers)
            for state in meta.state_saves:  # the forward is done: vLLM's state blocks hold this step's states
                out = torch.empty(size, dtype=torch.uint8)
                read_state(self.state_layers, [state.block_ids[slot] for slot in self.state_slot], out)
                blocks.append(KvBlock.build(BlockKey(state.key), None, self.options.model_id, "uint8", (size,),
                                            state.token_ids, memoryview(out.numpy()).cast("B")))
        if blocks and self.link.put_soon(blocks) is not None:
            self.saved_blocks += len(blocks)
