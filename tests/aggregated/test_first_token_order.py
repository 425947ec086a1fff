"""A prompt completed by a mixed step gets its first token sampled before the next step runs.

The engine thread runs calls in the order they are queued. If the batcher queued its next step
before the prompt's caller queued the first token's sampling, every first token would wait one
more step (up to a 256-token chunk's time) whenever anything else is in flight; the simulator
(``loadtest/simulator/one_machine.py``) and the prefill batcher both assume it does not.
"""

from __future__ import annotations

import asyncio
import threading

from crescent.services.aggregated.batcher import MixedBatcher
from crescent.services.instance.runtime import EngineWorker
from tests.engine import test_engine


async def test_first_token_is_sampled_before_the_next_step() -> None:
    engine = test_engine.make_engine()
    order: list[str] = []
    real_step = engine.mixed_step

    def recorded_step(chunks, decoding):  # runs on the engine thread, in queue order
        order.append("step")
        return real_step(chunks, decoding)

    engine.mixed_step = recorded_step
    worker = EngineWorker("test-aggregated")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()
    batcher = MixedBatcher(engine, worker, 8, 10.0, chunk_tokens=64)
    # 64 tokens per step: the short prompt's 40 end in step 1 (beside 16 of the long one's), the
    # long one goes on in step 2.
    short = engine.add_sequence("short", test_engine.prompt(40), use_cache=False)
    long = engine.add_sequence("long", test_engine.prompt(200, seed=2), use_cache=False)

    async def serve_short() -> None:  # what prefill's servicer does with a prompt's logits
        await batcher.prefill(short)
        await worker.run(lambda: order.append("sample short"))

    batcher.start()
    try:
        await asyncio.wait_for(asyncio.gather(serve_short(), batcher.prefill(long)), timeout=60)
    finally:
        await batcher.stop()
        worker.shutdown()
        await asyncio.to_thread(thread.join)
    assert order[:3] == ["step", "sample short", "step"], order
