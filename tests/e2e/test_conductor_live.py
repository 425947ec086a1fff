"""The Conductor in the running platform: hot-prefix replication between prefill instances,
load reports, SLO-based early rejection (HTTP 429) and the scheduler's metrics.

One ``crescent up --prefill 2 --decode 1`` stack (real processes) with a tight TTFT SLO set
through the scheduler's environment, and prefill without the kvstore, so that a peer's engine
cache is the only place a cached prefix can come from.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from crescent.services.model.model_source import DEFAULT_MODEL
from tests.admin_channel import admin_channel
from tests.e2e.stack import Stack, start_stack, stop_stack
from tests.e2e.test_request_path import LONG_CONTEXT, ask, client, reference_reply

pytestmark = pytest.mark.slow

TTFT_SLO_S = 6.0     # the default cost model predicts ~4.5 s for 1,500 new tokens, ~9 s for 3,000
BLOCK = 64
HOT_CONTEXT = (LONG_CONTEXT * 2).replace("Crescent Hardware", "Crescent Garden Centre")  # ~700 tokens


@pytest.fixture(scope="module")
def conductor_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    env = {"CRESCENT_SCHEDULER__SLO__TTFT_S": str(TTFT_SLO_S), "CRESCENT_PREFILL__KVSTORE_ADDRESS": ""}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        running = start_stack(tmp_path_factory.mktemp("conductor"), "--prefill", "2", "--decode", "1",
                              "--kv-capacity-tokens", "8192")
    yield running
    stop_stack(running)


def instances(stack: Stack) -> dict[str, scheduler_pb2.InstanceStatus]:
    with admin_channel(stack.run_dir, stack.service("scheduler")["grpc"]) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)
    return {s.info.instance_id: s for s in reply.instances}


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def shared_blocks(a: list[int], b: list[int]) -> int:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return min(common, len(b) - 1) // BLOCK


def test_hot_prefix_placed_on_the_other_prefill_is_pulled_and_kept(conductor_stack, reference):
    stack = conductor_stack
    first = [{"role": "system", "content": HOT_CONTEXT}, {"role": "user", "content": "Do gift cards expire?"}]
    hot = [{"role": "system", "content": HOT_CONTEXT}, {"role": "user", "content": "When do you open on Sunday?"}]
    busy = [{"role": "system", "content": "You index inventory."},
            {"role": "user", "content": " ".join(f"sku{i}" for i in range(320))}]  # ~1,350 tokens
    _, tokenizer = reference
    first_ids = tokenizer.encode(tokenizer.apply_chat_template(first))
    hot_ids, cold_text, _ = reference_reply(reference, hot, 16)
    expected = shared_blocks(first_ids, hot_ids)
    assert expected >= 8

    # Both prefill instances idle and empty: ties go to prefill-0, which now holds the prefix.
    ask(stack, first, 1)
    wait_for(lambda: instances(stack)["prefill-0"].indexed_blocks >= expected, 10, "prefill-0's blocks in the index")
    assert instances(stack)["prefill-1"].indexed_blocks == 0
    stack.wait_heartbeats(("prefill-0",))  # then the scheduler stops counting that request as its pending work

    # Keep prefill-0 busy with an unrelated long prompt; its heartbeat reports the tokens waiting.
    busy_thread = threading.Thread(target=ask, args=(stack, busy, 1))
    busy_thread.start()
    try:
        wait_for(lambda: instances(stack)["prefill-0"].load.queued_tokens > 1000, 10, "prefill-0 to report its queue")
        pulls_before = stack.metric("scheduler", "crescent_scheduler_prefix_pulls_total")
        placed_before = stack.metric("scheduler", "crescent_scheduler_placements_total", {"prefill": "prefill-1"})
        reply = ask(stack, hot, 16)
    finally:
        busy_thread.join(timeout=120)

    # The scheduler chose the idle instance and told it to pull the prefix from prefill-0 ...
    assert stack.metric("scheduler", "crescent_scheduler_prefix_pulls_total") == pulls_before + 1
    assert stack.metric("scheduler", "crescent_scheduler_placements_total", {"prefill": "prefill-1"}) == placed_before + 1
    peer = stack.metric("prefill-1", "crescent_engine_cached_tokens_total", {"source": "peer"})
    assert peer == expected * BLOCK
    assert stack.metric("prefill-1", "crescent_engine_kv_transfer_bytes_total", {"direction": "from_peer"}) > 0
    assert stack.metric("prefill-0", "crescent_engine_kv_transfer_bytes_total", {"direction": "to_peer"}) > 0
    # ... the reply is what a cold single-process run produces ...
    assert reply.usage.prompt_tokens_details.cached_tokens == expected * BLOCK
    assert reply.choices[0].message.content == cold_text
    # ... and prefill-1 kept the blocks: the scheduler now knows two replicas of the hot prefix.
    wait_for(lambda: instances(stack)["prefill-1"].indexed_blocks >= expected, 10, "prefill-1's replica in the index")
    assert instances(stack)["prefill-0"].indexed_blocks >= expected


def long_prompt() -> list[dict]:
    return [{"role": "user", "content": " ".join(f"entry{i}" for i in range(1000))}]  # ~3,000 tokens


def test_request_predicted_to_miss_the_ttft_slo_is_a_429_for_the_openai_client(conductor_stack):
    stack = conductor_stack
    before = stack.metric("scheduler", "crescent_scheduler_rejections_total", {"reason": "ttft_slo"})
    with pytest.raises(openai.RateLimitError) as caught:
        client(stack).chat.completions.create(model=DEFAULT_MODEL, messages=long_prompt(), max_tokens=8)
    error = caught.value
    assert error.status_code == 429
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.body["type"] == "rate_limit_error"
    assert "time to first token" in error.body["message"]
    assert stack.metric("scheduler", "crescent_scheduler_rejections_total", {"reason": "ttft_slo"}) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_rejection_reaches_a_raw_http_client_before_any_work(conductor_stack, stream):
    stack = conductor_stack
    computed_before = sum(
        stack.metric(f"prefill-{i}", "crescent_engine_prompt_tokens_total") for i in range(2)
    )
    started = time.monotonic()
    response = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
        "model": DEFAULT_MODEL, "messages": long_prompt(), "max_tokens": 8, "stream": stream,
    })
    assert time.monotonic() - started < 3, "an early rejection must not wait for prefill"
    assert response.status_code == 429
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"]
    # The prediction (~9.5 s) misses the 6 s SLO by a few seconds: Retry-After says roughly that.
    assert retry_after <= 10
    assert sum(stack.metric(f"prefill-{i}", "crescent_engine_prompt_tokens_total") for i in range(2)) == computed_before


def test_scheduler_metrics_show_placements_rejections_and_predicted_vs_actual_ttft(conductor_stack):
    stack = conductor_stack
    reply = ask(stack, [{"role": "user", "content": "Say hi."}], 2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    metric = lambda name, labels=None: stack.metric("scheduler", name, labels)  # noqa: E731
    assert metric("crescent_scheduler_placements_total") >= 1
    assert metric("crescent_scheduler_rejections_total", {"reason": "ttft_slo"}) >= 1
    assert metric("crescent_scheduler_predicted_ttft_seconds_count") >= 1
    # The gateway reports the measured TTFT after the first token, in the background.
    wait_for(lambda: metric("crescent_scheduler_observed_ttft_seconds_count") >= metric("crescent_scheduler_placements_total"),
             5, "an outcome report for every placement")
    assert metric("crescent_scheduler_ttft_prediction_error_seconds_count") >= 1
    assert metric("crescent_scheduler_observed_ttft_seconds_sum") > 0

