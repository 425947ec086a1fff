"""The connector's worker side (vLLM's model-runner process): KV into vLLM's blocks from the
kvstore before a step, and out of them into Crescent blocks as each layer finishes.

Loads are pipelined by layer (``layer_loads.py``): ``start_load_kv`` hands the step's blocks to a
loader thread, which fetches them, checks them and writes them into vLLM's cache one layer at a
time, and each attention layer waits for its own layer (``wait_for_layer_load``) while the loader
writes the next. A block the store no longer has, or whose bytes, tokens, layout or dtype do not
match, is never written and is reported as a load error, so vLLM recomputes from there
(``kv_load_failure_policy: recompute``): a bad or missing block is a miss, never wrong output. Saves copy a finished layer's rows of the step's
completed prompt blocks into one staging tensor per block as ``save_kv_layer`` is called (on a
GPU, the device-to-host copies overlap the later layers), and queue the blocks for the kvstore
once the step's forward is done.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import torch

from crescent.services.instance.wire import block_tensor
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.kv_layout import LayerGeometry, geometry, read_layer, write_layer
from crescent.services.engine_vllm.layer_loads import LayerLoader, LoadBatch
from crescent.services.engine_vllm.store_link import StoreLink
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock

if TYPE_CHECKING:  # vLLM's base class: this module stays importable (and testable) without vLLM
    from crescent.services.engine_vllm.connector_metadata import CrescentConnectorMetadata

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _layer_order(name: str) -> tuple[int, str]:
    found = _LAYER_INDEX.search(name)
    return (int(found.group(1)) if found else -1, name)


class ConnectorWorker:
    def __init__(self, options: ConnectorOptions, link: StoreLink | None, layout: str, num_blocks: int) -> None:
        self.options = options
        self.link = link
        self.layout = layout          # vLLM's attention layout (kv_layout.attention_layout)
        self.num_blocks = num_blocks
        self.layers: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.geo: LayerGeometry | None = None
        self._staging: dict[int, torch.Tensor] = {}  # vLLM block id -> its Crescent payload being filled
        self._load_errors: set[int] = set()
        self._loader = LayerLoader()
        self._batch: LoadBatch | None = None  # this step's loads, placed layer by layer
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        self.layer_index = {name: i for i, name in enumerate(names)}
        self.layers = [kv_caches[name] for name in names]
        self.geo = geometry(self.layers, self.layout, self.num_blocks)
        log.info("Crescent connector: %d KV layers, blocks %s (%s)", len(names), self.geo.kv_format, self.geo.dtype_name)

    # -- loads -------------------------------------------------------------------------------------

    def load(self, meta: CrescentConnectorMetadata) -> None:
        """Start this step's loads (``start_load_kv``); layers are awaited by ``wait_for_layer``."""
        self.finish_loads()  # a batch a step left unawaited (none in vLLM's order) is joined first
        if self.link is None or self.geo is None or not meta.loads:
            return
        self._batch = self._loader.start(len(self.layers), lambda batch: self._place(meta, batch))

    def _place(self, meta: CrescentConnectorMetadata, batch: LoadBatch) -> None:
        """On the loader thread: fetch and check every block, then write them layer by layer."""
        assert self.link is not None and self.geo is not None
        placed: list[tuple[int, torch.Tensor]] = []
        for spec in meta.loads:
            batch.claim(spec.block_ids)  # each is an error until every layer of it is written
            blocks = self.link.get_prefix([BlockKey(k) for k in spec.keys])
            count = 0
            for block, tokens, block_id in zip(blocks, spec.token_ids, spec.block_ids):
                payload = self._payload_of(block, tokens)
                if payload is None:
                    break
                placed.append((block_id, payload))
                count += 1
            if count < len(spec.block_ids):
                log.info("request %s: %d of %d kvstore blocks loaded; vLLM recomputes the rest",
                         spec.request_id, count, len(spec.block_ids))
        for layer, view in enumerate(self.layers):
            for block_id, payload in placed:
                write_layer(self.geo, view, block_id, payload[layer])
            batch.layer_done(layer)
        batch.placed(block_id for block_id, _ in placed)
        self.loaded_blocks += len(placed)

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
        for spec in meta.saves:
            staging = self._staging.get(spec.block_id)
            if staging is None:
                staging = self._staging[spec.block_id] = torch.empty(self.geo.block_shape, dtype=self.geo.dtype)
            read_layer(self.geo, kv_layer, spec.block_id, staging[layer])

    def finish_saves(self, meta: CrescentConnectorMetadata) -> None:
        if self.link is None or self.geo is None or not meta.saves:
            self._staging.clear()
            return
        blocks = []
        for spec in meta.saves:
            staging = self._staging.get(spec.block_id)
            if staging is None:
                continue
            payload = memoryview(staging.view(torch.uint8).numpy()).cast("B")
            blocks.append(KvBlock.build(BlockKey(spec.key), BlockKey(spec.parent_key) if spec.parent_key else None,
                                        self.options.model_id, self.geo.dtype_name, self.geo.block_shape,
                                        spec.token_ids, payload))
        self._staging.clear()
        if blocks and self.link.put_soon(blocks) is not None:
            self.saved_blocks += len(blocks)
