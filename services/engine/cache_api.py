"""What the data plane may ask of an engine's KV cache, as typed capabilities instead of
``hasattr`` probes. Three caches implement them: ``PagedKvCache`` (Llama family), ``K3Cache``
(the hybrid: latents plus recurrent states) and ``ShardedKvCache`` (a tensor-parallel leader's).

- ``KvCache``: pages, block payloads in and out; every cache.
- ``LayeredKvCache``: its payload lies layer after layer (``layer_layout``), so decode can take a
  handoff a layer at a time.
- ``LayerCopyingKvCache``: it can also copy one layer of one page out while later layers compute,
  so prefill can hand off and export a layer at a time (not the tensor-parallel cache, whose
  layers are spread over the group).
- ``StatefulKvCache``: it keeps recurrent states beside the pages (one live state per running
  sequence, snapshots at chosen blocks); a block's payload may carry one. An exporter
  ``stage``s a state on the engine thread (a device-side clone, no wait) and copies it to the
  host on its own thread (``device_staging.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from crescent.services.engine.device_staging import Staged
from crescent.services.engine.kv_cache import PageManager
from crescent.services.kvwire.layer_wire import LayerLayout


@runtime_checkable
class KvCache(Protocol):
    pages: PageManager
    block_size: int

    @property
    def block_shape(self) -> tuple[int, ...]: ...

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def wire_dtype(self) -> torch.dtype: ...

    def nbytes(self) -> int: ...

    def payload_shape(self, num_tokens: int) -> tuple[int, ...]: ...

    def payload_tokens(self, shape: Sequence[int]) -> int: ...

    def read_block(self, page: int, num_tokens: int | None = None) -> torch.Tensor: ...

    def write_block(self, page: int, payload: torch.Tensor) -> None: ...


@runtime_checkable
class LayeredKvCache(KvCache, Protocol):
    def layer_layout(self) -> LayerLayout: ...


@runtime_checkable
class LayerCopyingKvCache(LayeredKvCache, Protocol):
    def copy_layer(self, page: int, layer: int, num_tokens: int, out: memoryview) -> None: ...


@runtime_checkable
class StatefulKvCache(KvCache, Protocol):
    def open_state(self) -> int: ...

    def close_state(self, handle: int) -> None: ...

    def copy_snapshot(self, page: int, out: memoryview) -> None: ...

    def stage_live_state(self, handle: int) -> Staged: ...

    def stage_snapshot(self, page: int) -> Staged: ...

    @staticmethod
    def payload_has_state(shape: Sequence[int]) -> bool: ...
