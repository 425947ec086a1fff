"""Hot-prefix pulls when the peer cannot deliver, and the load a prefill instance reports.

The pull that works is covered end to end in tests/e2e/test_conductor_live.py.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.prefix_pull import PeerDirectory, PrefixPuller
from tests.engine.tiny_model import tiny_model
from tests.scheduler.support import free_port

PAGE = 16
_METRICS = engine_metrics("prefill")  # cached: the same metrics a prefill servicer in this process uses


class FixedDirectory(PeerDirectory):
    def __init__(self, addresses: dict[str, str]) -> None:
        super().__init__(f"127.0.0.1:{free_port()}")
        self._addresses = dict(addresses)
        self._refreshed_at = float("inf")  # never ask the (absent) scheduler


def test_a_peer_that_is_gone_costs_a_recompute_not_an_error() -> None:
    torch.set_num_threads(1)
    engine = Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=16 * PAGE, block_size=PAGE)
    worker = EngineWorker("test")
    serving = threading.Thread(target=worker.serve_forever)
    serving.start()

    async def scenario() -> tuple[int, int, bool]:
        directory = FixedDirectory({"prefill-9": f"127.0.0.1:{free_port()}"})
        puller = PrefixPuller(engine, worker, _METRICS, directory)
        seq = engine.add_sequence("r", list(range(5 * PAGE)))
        try:
            unknown = await puller.pull(seq, "kvstore-0", 4)  # not a prefill instance: the kvstore path's job
            gone = await puller.pull(seq, "prefill-9", 4)
            return unknown, gone, "prefill-9" in directory._addresses
        finally:
            await puller.close()

    try:
        unknown, gone, still_known = asyncio.run(scenario())
    finally:
        worker.shutdown()
        serving.join()
    assert (unknown, gone) == (0, 0)
    assert not still_known, "an unreachable peer's address is looked up again next time"


def test_load_counts_prompt_tokens_still_to_compute() -> None:
    load = PrefillLoad()
    load.admit("a", 1000)
    load.admit("b", 300)
    assert load.report() == (2, 1300, 0)
    load.cached("a", 640)           # a prefix hit is not work
    load.computing("a")
    assert load.report() == (1, 660, 1)
    load.done("a")
    load.done("a")                  # the request's end after its prefill: nothing changes
    assert load.report() == (1, 300, 0)


def test_load_names_the_requests_held_and_those_that_left_once() -> None:
    nudges = []
    load = PrefillLoad(on_change=lambda: nudges.append(1))
    load.admit("a", 100)
    load.admit("b", 100)
    load.done("a")                  # computed, still handing off: held
    assert load.active_ids() == ["a", "b"]
    load.left("a")
    load.left("a")
    assert load.active_ids() == ["b"]
    assert load.drain_left() == ["a"]
    assert load.drain_left() == [], "each departure is reported once"
    assert len(nudges) == 3, "arrivals and departures reach the scheduler at once"


class NoLookups(FixedDirectory):
    """A directory that must not be asked: the placement already carries the address."""

    def __init__(self) -> None:
        super().__init__({})
        self.forgotten: list[str] = []

    async def address(self, instance_id: str) -> str | None:
        raise AssertionError(f"looked up {instance_id} although the placement gave its address")

    def forget(self, instance_id: str) -> None:
        self.forgotten.append(instance_id)


def test_the_placement_s_prefix_source_address_is_dialled_without_a_lookup() -> None:
    torch.set_num_threads(1)
    engine = Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=16 * PAGE, block_size=PAGE)
    worker = EngineWorker("test")
    serving = threading.Thread(target=worker.serve_forever)
    serving.start()

    async def scenario() -> tuple[int, list[str]]:
        directory = NoLookups()
        puller = PrefixPuller(engine, worker, _METRICS, directory)
        seq = engine.add_sequence("r", list(range(5 * PAGE)))
        try:
            added = await puller.pull(seq, "prefill-7", 4, address=f"127.0.0.1:{free_port()}")
            return added, directory.forgotten
        finally:
            await puller.close()

    try:
        added, forgotten = asyncio.run(scenario())
    finally:
        worker.shutdown()
        serving.join()
    assert added == 0  # nobody answers there: the prompt is computed instead
    assert forgotten == ["prefill-7"], "the given address was dialled (and found gone)"
