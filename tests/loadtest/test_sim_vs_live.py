"""Simulated vs live TTFT (``loadtest/sim_vs_live.py``, ``loadtest/simulator/one_machine.py``).

Cases small enough to work out by hand: requests far apart take exactly their prefill cost,
overlapping ones queue behind each other or share a step, an aggregated prompt is cut into the
chunks the live batcher cuts and pays for the decode rows it shares its steps with. The chunk
planners are checked against the live engines' own planning code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from crescent.services.aggregated.batcher import MixedBatcher
from crescent.services.prefill.batcher import plan_step
from crescent.services.scheduler.cost_model import (
    CostModels, DecodeCostModel, MixedStepCostModel, PrefillCostModel, TransferCostModel,
)
from crescent.services.scheduler.datatypes import Tier
from loadtest import sim_vs_live
from loadtest.simulator.one_machine import (
    AggregatedSetup, PoolsSetup, ReplayedRequest, _Job, aggregated_chunks, prefill_chunks, simulate_aggregated,
    simulate_pools,
)

PREFILL = PrefillCostModel(fixed_s=0.1, per_token_s=0.001, attention_s=0.0)
DECODE = DecodeCostModel(fixed_s=0.05, per_sequence_s=0.01, per_context_token_s=0.0)
MIXED = MixedStepCostModel(fixed_s=0.1, per_prompt_token_s=0.001, attention_s=0.0, per_sequence_s=0.01,
                           per_context_token_s=0.0)
TRANSFER = TransferCostModel(kv_bytes_per_token=1000, latency_s=0.0, bytes_per_s={t: 1e9 for t in Tier})
COSTS = CostModels(PREFILL, DECODE, TRANSFER, MIXED)
# The live engines' settings as these cases assume them (the simulator's defaults follow the live ones).
POOLS = PoolsSetup(prefill_chunk_tokens=2048, max_batch_tokens=2048, max_batch=16)
AGGREGATED = AggregatedSetup(chunk_tokens=256, block_size=64, max_batch=16)


def req(index: int, arrival: float, prompt: int, cached: int = 0, output: int = 1) -> ReplayedRequest:
    return ReplayedRequest(index, arrival, prompt, cached, output)


# ---- pools: one prefill + one decode engine ---------------------------------------------------

def test_pools_requests_far_apart_take_their_prefill_cost() -> None:
    costs = CostModels(PrefillCostModel(0.1, 0.001, 1e-6), DECODE, TRANSFER)
    ttft = simulate_pools([req(0, 0.0, 500, output=4), req(1, 100.0, 300, cached=128)], costs, POOLS)
    assert ttft[0] == pytest.approx(0.1 + 0.5 + 1e-6 * 500**2 / 2)
    # 172 new tokens after 128 cached: each sees the cached ones and the new ones before it.
    assert ttft[1] == pytest.approx(0.1 + 0.172 + 1e-6 * (172 * 128 + 172**2 / 2))


def test_pools_overlapping_requests_queue_or_share_a_step() -> None:
    # The second arrives while the first's step runs: it waits for the step to end.
    ttft = simulate_pools([req(0, 0.0, 500), req(1, 0.1, 300)], COSTS, POOLS)
    assert ttft == pytest.approx({0: 0.6, 1: 0.6 + 0.4 - 0.1})
    # Queued together: one step with one fixed cost (prefill batching) ...
    ttft = simulate_pools([req(0, 0.0, 500), req(1, 0.0, 300)], COSTS, POOLS)
    assert ttft == pytest.approx({0: 0.9, 1: 0.9})
    # ... or one prompt per step with max_batch_tokens 0.
    ttft = simulate_pools([req(0, 0.0, 500), req(1, 0.0, 300)], COSTS, PoolsSetup(2048, 0, 16))
    assert ttft == pytest.approx({0: 0.6, 1: 1.0})
    # ... or queued together beyond max_batch_tokens: the oldest runs, the next waits for the step after.
    ttft = simulate_pools([req(0, 0.0, 500), req(1, 0.0, 300)], COSTS, PoolsSetup(2048, 512, 16))
    assert ttft == pytest.approx({0: 0.6, 1: 1.0})


def test_pools_prefill_beside_a_decoding_batch_costs_the_contended_model() -> None:
    beside = PrefillCostModel(fixed_s=0.1, per_token_s=0.002, attention_s=0.0)  # half the threads: twice per token
    costs = CostModels(PREFILL, DECODE, TRANSFER, prefill_beside_decode=beside)
    # Request 0: 0.2 s of prefill, handoff (0.1 ms), then two decode steps (0.06 s each) to 0.3201 s.
    # Request 1 arrives at 0.25 while decode steps: its prefill runs on the contended model.
    ttft = simulate_pools([req(0, 0.0, 100, output=3), req(1, 0.25, 100)], costs, POOLS)
    assert ttft == pytest.approx({0: 0.2, 1: 0.1 + 0.2})
    # Decode idle by 1.0 s: the model measured alone again.
    ttft = simulate_pools([req(0, 0.0, 100, output=3), req(1, 1.0, 100)], costs, POOLS)
    assert ttft == pytest.approx({0: 0.2, 1: 0.2})


def test_pools_long_prompt_is_cut_into_prefill_chunks() -> None:
    ttft = simulate_pools([req(0, 0.0, 5000)], COSTS, POOLS)
    assert ttft[0] == pytest.approx(3 * 0.1 + 5.0)  # 2048 + 2048 + 904, a fixed cost each


# ---- aggregated: one engine, prompt chunks mixed into decode steps ----------------------------

def test_aggregated_prompt_runs_in_block_aligned_chunks() -> None:
    # 600 tokens, 128 cached, blocks of 64, chunks of 256: 128→384, then 384→600.
    ttft = simulate_aggregated([req(0, 0.0, 600, cached=128)], MIXED, AGGREGATED)
    assert ttft[0] == pytest.approx((0.1 + 0.256) + (0.1 + 0.216))


def test_aggregated_prompt_waits_for_the_step_and_shares_it_with_decode() -> None:
    # Request 0: 100-token prompt (0.2 s), then decode steps of batch 1 (0.11 s) for tokens 2 and 3.
    # Request 1 arrives at 0.25, inside the first decode step (0.2–0.31): its 200-token prompt
    # runs in the next step beside request 0's last token: 0.1 + 0.2 + 0.01 = 0.31 s.
    ttft = simulate_aggregated([req(0, 0.0, 100, output=3), req(1, 0.25, 200)], MIXED, AGGREGATED)
    assert ttft[0] == pytest.approx(0.2)
    assert ttft[1] == pytest.approx(0.31 + 0.31 - 0.25)


def test_aggregated_finished_prompt_decodes_from_the_step_after_next() -> None:
    # Step 1 (0.328 s): the first prompt's 100 tokens and 128 of the second's (256 tokens, the
    # second's chunk ending on a block). Step 2 (0.272 s): the second's last 172 tokens, without a
    # decode row: the first request is handed over to decoding while step 2 runs.
    ttft = simulate_aggregated([req(0, 0.0, 100, output=5), req(1, 0.0, 300)], MIXED, AGGREGATED)
    assert ttft == pytest.approx({0: 0.328, 1: 0.328 + 0.272})


def test_aggregated_chunk_budget_is_shared_oldest_first() -> None:
    # Both queued at 0 with 256 tokens per step: the first's 200, and the 56 left are less than
    # a 64-token block (a chunk that does not end its prompt ends on a block): the second waits.
    ttft = simulate_aggregated([req(0, 0.0, 200), req(1, 0.0, 100)], MIXED, AGGREGATED)
    assert ttft[0] == pytest.approx(0.3)
    assert ttft[1] == pytest.approx(0.3 + 0.2)


def _fake_seq(prompt: int, computed: int) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=prompt, num_computed=computed, pages=[], decode_tail=0)


@pytest.mark.parametrize("seed", range(20))
def test_chunk_planners_match_the_live_engines(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([16, 64])
    queue = []
    for i in range(rng.randint(1, 6)):
        prompt = rng.randint(2, 1500)
        computed = rng.randrange(0, prompt) // block * block
        queue.append(_Job(req(i, 0.0, prompt, cached=computed), block))
    chunk = rng.choice([128, 256, 512])
    live_batcher = SimpleNamespace(
        chunk_tokens=chunk, engine=SimpleNamespace(block_size=block),
        prompts=[SimpleNamespace(seq=_fake_seq(j.req.prompt_tokens, j.computed), done=SimpleNamespace(done=lambda: False))
                 for j in queue])
    live = MixedBatcher._plan_chunks(live_batcher)
    ours = aggregated_chunks(queue, chunk, block)
    assert [(live_batcher.prompts.index(job), end) for job, end in live] == [(queue.index(j), end) for j, end in ours]
    seqs = [_fake_seq(j.req.prompt_tokens, j.computed) for j in queue]
    max_tokens = rng.choice([0, 512, 2048])
    live_step = plan_step(seqs, chunk, max_tokens, free_pages=10**6, block_size=block)
    ours_step = prefill_chunks(queue, chunk, max_tokens)
    assert [(seqs.index(s), end) for s, end in live_step] == [(queue.index(j), end) for j, end in ours_step]


# ---- the script: a live report and a cost file in, the comparison out --------------------------

def _row(index: int, arrival: float, *, ok: bool = True, status: str = "", ttft: float | None = None, prompt: int = 0,
         cached: int = 0, output: int = 1, words: int = 0) -> dict:
    return {"index": index, "arrival_s": arrival, "ok": ok, "status": status, "reason": "", "ttft_s": ttft,
            "tbt_s": None, "output_tokens": output if ok else 0, "prompt_tokens": prompt, "cached_tokens": cached,
            "max_tokens": output, "prompt_words": words}


LIVE_ROWS = [
    _row(0, 0.0, ttft=0.6, prompt=500, words=490),
    _row(1, 100.0, ttft=0.36, prompt=300, cached=100, words=290),
    _row(2, 150.0, ok=False, status="429", prompt=0, words=1000),    # refused: never ran, not replayed
    _row(3, 200.0, ok=False, status="unfinished", words=90),          # ran; its prompt: 90 words + 10 (template)
    _row(4, 200.05, ttft=0.35, prompt=100, words=90),                 # queued behind request 3's step
]


def _write(tmp_path: Path, rows: list[dict], costs: CostModels = COSTS) -> tuple[Path, Path]:
    live = tmp_path / "live.json"
    live.write_text(json.dumps({"url": "http://x", "per_request": rows}))
    p, d, m = costs.prefill, costs.decode, costs.mixed
    cost = {"prefill": {"fixed_s": p.fixed_s, "per_token_s": p.per_token_s, "attention_s": p.attention_s},
            "decode": {"fixed_s": d.fixed_s, "per_sequence_s": d.per_sequence_s, "per_context_token_s": d.per_context_token_s}}
    if m is not None:
        cost["mixed"] = {"fixed_s": m.fixed_s, "per_prompt_token_s": m.per_prompt_token_s, "attention_s": m.attention_s,
                         "per_sequence_s": m.per_sequence_s, "per_context_token_s": m.per_context_token_s}
    path = tmp_path / "costs.yaml"
    path.write_text("# crescent profile: test\n" + yaml.safe_dump({"cost": cost}))
    return live, path


def test_script_compares_the_same_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live, costs = _write(tmp_path, LIVE_ROWS)
    out = tmp_path / "result.json"
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "pools", "--json", str(out),
                             "--max-batch-tokens", "2048", "--prefill-chunk-tokens", "2048"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["requests"], result["replayed"], result["refused_live"]) == (3, 4, 1)
    # Simulated: 0.6, 0.1 + 0.2 = 0.3, and 0.35 (request 3's 100 tokens run 200.0–200.2, request 4's 200.2–200.4).
    assert result["simulated"]["mean"] == pytest.approx((0.6 + 0.3 + 0.35) / 3)
    assert result["live"]["mean"] == pytest.approx((0.6 + 0.36 + 0.35) / 3)
    assert result["simulated"]["p50"] == pytest.approx(0.35) and result["live"]["p50"] == pytest.approx(0.36)
    assert result["relative_error"]["p50"] == pytest.approx(0.35 / 0.36 - 1)
    assert result["all_within"] is True
    assert result["largest_differences"][0] == {"index": 1, "simulated_s": pytest.approx(0.3), "live_s": 0.36}
    assert "within 25% of live" in printed and "NOT" not in printed


def test_script_says_when_the_simulator_disagrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = CostModels(PrefillCostModel(0.2, 0.002, 0.0), DECODE, TRANSFER, MIXED)  # twice the live costs
    live, costs = _write(tmp_path, LIVE_ROWS, slow)
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "pools"]) == 0
    printed = capsys.readouterr().out
    assert "NOT within 25%" in printed
    # The aggregated mode on the same requests, with the mixed model: request 0 runs in chunks of
    # 256 and 244 tokens; request 1's 100 cached tokens count as one 64-token block (hits are whole
    # blocks), so it computes 236; request 4 again queues behind request 3 (0.35 s).
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "aggregated", "--chunk-tokens", "256",
                             "--block-size", "64", "--json", str(tmp_path / "agg.json")]) == 0
    result = json.loads((tmp_path / "agg.json").read_text())
    assert result["simulated"]["mean"] == pytest.approx((0.356 + 0.344 + 0.336 + 0.35) / 3)


def test_script_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pools_only = CostModels(PREFILL, DECODE, TRANSFER)
    live, costs = _write(tmp_path, LIVE_ROWS, pools_only)
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "aggregated"]) == 2
    assert "no cost.mixed section" in capsys.readouterr().err
    live.write_text(json.dumps([{"per_request": LIVE_ROWS}, {"per_request": LIVE_ROWS}]))
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "pools"]) == 2
    assert "--run 0..1" in capsys.readouterr().err
    live.write_text(json.dumps({"per_request": [{"index": 0, "ok": True}]}))
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "pools"]) == 2
    assert "lacks arrival_s" in capsys.readouterr().err
    no_size = [_row(0, 0.0, ttft=0.5, prompt=0, words=0)]  # no usage reported, an old replay's row
    live.write_text(json.dumps({"per_request": no_size}))
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs), "--mode", "pools"]) == 2
    assert "request 0 has no prompt size" in capsys.readouterr().err
    costs.write_text("slo: {}\n")
    assert sim_vs_live.main(["--live", str(live), "--costs", str(costs)]) == 2
    assert "no 'cost:' section" in capsys.readouterr().err


def test_cluster_simulator_takes_the_profiled_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest import simulate

    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    _, costs = _write(tmp_path, [])
    argv = ["--trace", str(trace), "--policies", "kvcache_centric", "--prefill", "1", "--decode", "1", "--json"]
    assert simulate.main([*argv, "--costs", str(costs)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["ttft_avg"] == pytest.approx(0.1 + 1.024)  # one prompt, alone: its prefill cost
    (tmp_path / "bad.yaml").write_text("cost: {prefill: {fixed_s: -1}}\n")
    assert simulate.main([*argv, "--costs", str(tmp_path / "bad.yaml")]) == 2
    assert "invalid cost section" in capsys.readouterr().err


def test_simulated_engines_default_to_the_live_settings() -> None:
    from crescent.services.aggregated.config import AggregatedSettings
    from crescent.services.engine.settings import EngineSettings
    from crescent.services.prefill.config import PrefillSettings

    engine = EngineSettings()
    prefill = PrefillSettings(scheduler_address="x:1")
    aggregated = AggregatedSettings(scheduler_address="x:1")
    assert AggregatedSetup() == AggregatedSetup(aggregated.chunk_tokens, engine.block_size, engine.max_batch_size)
    assert PoolsSetup() == PoolsSetup(engine.prefill_chunk_tokens, prefill.max_batch_tokens, engine.max_batch_size)
