"""Loads that finish layer by layer, as vLLM's connector interface intends: ``start_load_kv``
starts a step's loads and each attention layer calls ``wait_for_layer_load`` just before it reads
its KV. A ``LoadBatch`` is one step's loads; a single ``LayerLoader`` thread per worker fetches
the batch's blocks and writes them one layer after another, marking each layer done, so layer
``i``'s attention runs while the loader writes layer ``i + 1``.

A block counts as an error until every layer of it has been written: a fetch that fails, a check
that refuses it, or an exception half-way through leaves it in ``join()``'s answer, which the
connector reports to vLLM as a load error (recomputed). Every layer is marked done whatever
happens, so a waiting attention layer never hangs; it may then read a block that was not
written, but that block is reported, and vLLM discards the step's output for its request and
recomputes from there (``kv_load_failure_policy: recompute``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class LoadBatch:
    def __init__(self, num_layers: int) -> None:
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._unplaced: set[int] = set()

    # -- the loader's side -------------------------------------------------------------------------

    def claim(self, block_ids: Iterable[int]) -> None:
        """These vLLM blocks are to be loaded: errors until ``placed``."""
        with self._lock:
            self._unplaced.update(block_ids)

    def placed(self, block_ids: Iterable[int]) -> None:
        """These blocks have every layer written."""
        with self._lock:
            self._unplaced.difference_update(block_ids)

    def layer_done(self, layer: int) -> None:
        self._layers[layer].set()

    def finish(self) -> None:
        for event in self._layers:
            event.set()
        self._finished.set()

    # -- the forward's side ------------------------------------------------------------------------

    def wait_layer(self, layer: int) -> None:
        self._layers[layer].wait()

    def join(self) -> set[int]:
        """Wait for the whole batch; the vLLM block ids it did not place."""
        self._finished.wait()
        with self._lock:
            return set(self._unplaced)


class LayerLoader:
    """One daemon thread running batches in order (a worker's steps come one at a time)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[LoadBatch, Callable[[LoadBatch], None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, num_layers: int, place: Callable[[LoadBatch], None]) -> LoadBatch:
        """Run ``place(batch)`` on the loader thread; it claims, writes, and marks layers done."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="crescent-kv-loads", daemon=True)
            self._thread.start()
        batch = LoadBatch(num_layers)
        self._jobs.put((batch, place))
        return batch

    def _run(self) -> None:
        while True:
            batch, place = self._jobs.get()
            try:
                place(batch)
            except Exception:  # noqa: BLE001 - the batch's unplaced blocks become load errors
                log.exception("loading KV blocks failed; vLLM recomputes them")
            finally:
                batch.finish()
