"""The connector's worker side (vLLM's model-runner process): KV into vLLM's blocks from the
kvstore before a step, and out of them into Crescent blocks as each layer finishes.

Loads are synchronous (``start_load_kv`` returns once every planned block is in place): a block
the store no longer has, or whose bytes, tokens, layout or dtype do not match, is reported as a
load error and vLLM recomputes from there (``kv_load_failure_policy: recompute``), so a bad or
missing block is a miss, never wrong output. Saves copy a finished layer's rows of the step's
completed prompt blocks into one staging tensor per block as ``save_kv_layer`` is called (on a
GPU, the device-to-host copies overlap the later layers), and queue the blocks for the kvstore
once the step's forward is done.
"""

from __future__ import annotations

import logging
import re

import torch

from crescent.services.instance.wire import block_tensor
from crescent.services.engine_vllm.connector_metadata import CrescentConnectorMetadata
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.kv_layout import LayerGeometry, geometry, read_layer, write_block
from crescent.services.engine_vllm.store_link import StoreLink
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock

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
        if self.link is None or self.geo is None:
            return
        for spec in meta.loads:
            blocks = self.link.get_prefix([BlockKey(k) for k in spec.keys])
            placed = 0
            for block, tokens, block_id in zip(blocks, spec.token_ids, spec.block_ids):
                payload = self._payload_of(block, tokens)
                if payload is None:
                    break
                write_block(self.geo, self.layers, block_id, payload)
                placed += 1
            self.loaded_blocks += placed
            if placed < len(spec.block_ids):
                log.info("request %s: %d of %d kvstore blocks loaded; vLLM recomputes the rest",
                         spec.request_id, placed, len(spec.block_ids))
                self._load_errors.update(spec.block_ids[placed:])

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
