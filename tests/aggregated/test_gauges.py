"""The queue depth an aggregated instance exports: its prompts without a first token (what the
chart's autoscalers scale aggregated groups on, with KV use)."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from crescent.services.aggregated.batcher import MixedBatcher, PromptJob
from crescent.services.instance.runtime import EngineWorker
from tests.engine import test_engine


def _queue_depth() -> float | None:
    return REGISTRY.get_sample_value("crescent_engine_queue_depth", {"role": "aggregated"})


async def test_prompts_waiting_for_kv_room_or_chunks_count_as_queued() -> None:
    b = MixedBatcher(test_engine.make_engine(), EngineWorker("test"), 8, 10.0, 64)
    b._update_gauges()
    assert _queue_depth() == 0
    first = PromptJob(b.engine.add_sequence("a", test_engine.prompt(100), use_cache=False))
    second = PromptJob(b.engine.add_sequence("b", test_engine.prompt(40), use_cache=False))
    b.prompts.extend([first, second])
    b._reserving.append(("c", asyncio.get_running_loop().create_future()))  # no KV room yet
    b._update_gauges()
    assert _queue_depth() == 3
    first.done.set_result(None)  # computed: its first token is being sampled, no longer queued
    b._update_gauges()
    assert _queue_depth() == 2
