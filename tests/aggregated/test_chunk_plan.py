"""How an aggregated instance's batcher cuts prompts into the chunks each decode step carries."""

from __future__ import annotations

from crescent.services.aggregated.batcher import MixedBatcher, PromptJob
from crescent.services.instance.runtime import EngineWorker
from tests.engine import test_engine

PAGE = 16


def batcher(chunk_tokens: int) -> MixedBatcher:
    return MixedBatcher(test_engine.make_engine(), EngineWorker("test"), 8, 10.0, chunk_tokens)


async def test_several_queued_prompts_share_one_step_oldest_first_on_block_boundaries() -> None:
    b = batcher(chunk_tokens=70)  # rounded down to whole blocks: 64
    assert b.chunk_tokens == 64
    long = PromptJob(b.engine.add_sequence("long", test_engine.prompt(100), use_cache=False))
    short = PromptJob(b.engine.add_sequence("short", test_engine.prompt(40), use_cache=False))
    b.prompts.extend([long, short])
    plan = b._plan_chunks()
    # The oldest takes the whole budget (it does not end there, so the chunk ends on a block).
    assert [(job, end) for job, end in plan] == [(long, 64)]
    long.seq.num_computed = 64
    plan = b._plan_chunks()
    # 36 tokens finish the long prompt; the next one starts in the same step with what is left:
    # 28 tokens, cut to one whole block since they do not finish it.
    assert [(job.seq.seq_id, end) for job, end in plan] == [("long", 100), ("short", 16)]
    short.seq.num_computed = 16  # the long prompt completed and left the queue; this one goes on alone
    b.prompts.remove(long)
    assert [(job.seq.seq_id, end) for job, end in b._plan_chunks()] == [("short", 40)]


async def test_a_prompt_that_fits_the_budget_is_computed_to_its_end_in_one_chunk() -> None:
    b = batcher(chunk_tokens=256)
    job = PromptJob(b.engine.add_sequence("p", test_engine.prompt(37), use_cache=False))
    b.prompts.append(job)
    assert b._plan_chunks() == [(job, 37)]


async def test_a_moved_requests_decode_tail_goes_whole_and_waits_behind_a_full_step() -> None:
    b = batcher(chunk_tokens=64)
    moved = PromptJob(b.engine.add_sequence("moved", test_engine.prompt(100), use_cache=False, decode_tail=50))
    other = PromptJob(b.engine.add_sequence("other", test_engine.prompt(40), use_cache=False))
    b.prompts.extend([moved, other])
    # Its prompt part (50 tokens) ends where decode's tokens begin, off a block boundary.
    assert [(job.seq.seq_id, end) for job, end in b._plan_chunks()] == [("moved", 50)]
    moved.seq.num_computed = 50
    # The tail (50 rows) fits; the 14 tokens left are less than a block for "other".
    assert [(job.seq.seq_id, end) for job, end in b._plan_chunks()] == [("moved", 100)]
    b.prompts.reverse()  # behind a chunk that took the budget the tail waits a step, whole
    assert [(job.seq.seq_id, end) for job, end in b._plan_chunks()] == [("other", 40)]
