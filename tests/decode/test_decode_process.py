"""A real decode process overloaded with handoffs, aborted, and cancelled.

The decode instance's cache holds two of these requests at a time; it is sent more. What a user
would notice: every accepted request completes with the tokens of a single-process run, none
fails; a request that could never fit is refused with the numbers; a reader that goes away
frees its KV within a second; the scheduler hears which requests are held and what is free.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from crescent.protos import decode_pb2
from tests.decode.process import TEXTS, BLOCK, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub, stream_all

pytestmark = pytest.mark.slow  # real processes: a model load each

KV_TOKENS = 6 * BLOCK     # two requests of 3 pages each at a time
MAX_TOKENS = 40



@pytest.fixture(scope="module")
def prompts() -> PromptKv:
    return PromptKv()


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory):
    scheduler = SchedulerStandIn()
    process = DecodeProcess(tmp_path_factory.mktemp("decode"), scheduler.address, KV_TOKENS)
    try:
        process.start()
        yield process, scheduler.servicer
    finally:
        process.stop()
        scheduler.stop()


def padded(prompts: PromptKv, text: str) -> list[int]:
    """A prompt of 2 blocks + a bit: with MAX_TOKENS it reserves 3 pages."""
    ids = prompts.prompt(text * 4)
    return ids[: 2 * BLOCK + 8]


def test_more_handoffs_than_kv_all_complete_with_single_process_tokens(decode, prompts: PromptKv) -> None:
    process, scheduler = decode
    channel, stub = decode_stub(process.address)
    requests = {f"over-{i}": padded(prompts, text) for i, text in enumerate(TEXTS)}

    def one(request_id: str) -> tuple[int, list[int], str]:
        first, parts = prompts.handoff(request_id, requests[request_id], MAX_TOKENS)
        assert stub.Handoff(iter(parts), timeout=60).accepted
        tokens, reason = stream_all(stub, request_id)
        return first, tokens, reason

    with channel, ThreadPoolExecutor(len(requests)) as pool:
        results = dict(zip(requests, pool.map(one, requests)))
        references = {rid: prompts.reference(tokens, MAX_TOKENS) for rid, tokens in requests.items()}
    for request_id, (first, tokens, reason) in results.items():
        assert reason == "length", request_id
        assert [first, *tokens] == references[request_id], request_id

    info = scheduler.registered[-1]
    assert info.kv_format == "paged-v1:" + "x".join(str(d) for d in prompts.engine.cache.block_shape)
    assert info.kv_dtype == "float32"
    assert any(len(load.active_request_ids) == len(requests) and load.free_kv_tokens == 0 for load in scheduler.loads), \
        "while every request is held, all of the cache is promised"
    deadline = time.monotonic() + 5
    while not (set(requests) <= scheduler.finished_ids() and scheduler.loads[-1].free_kv_tokens == KV_TOKENS):
        assert time.monotonic() < deadline, "the scheduler should hear that every request left"
        time.sleep(0.05)
    assert not scheduler.loads[-1].active_request_ids


def test_a_request_that_could_never_fit_is_refused_with_the_numbers(decode, prompts: PromptKv) -> None:
    process, _ = decode
    _, parts = prompts.handoff("huge", padded(prompts, TEXTS[0]), KV_TOKENS)
    channel, stub = decode_stub(process.address)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.Handoff(iter(parts), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{KV_TOKENS} tokens" in refused.value.details()


def test_a_vllm_prefills_handoff_is_refused_by_the_native_decode(decode, prompts: PromptKv) -> None:
    """A vLLM prefill's handoff carries no KV (decode would load it from the kvstore and sample
    the first tokens): a native decode says so rather than decoding without the prompt's KV."""
    process, _ = decode
    _, parts = prompts.handoff("from-vllm", padded(prompts, TEXTS[0]), MAX_TOKENS)
    header = decode_pb2.HandoffHeader()
    header.CopyFrom(parts[0].header)
    header.num_blocks = 0
    header.vllm_cache_salt = "crs:" + "ab" * 16
    channel, stub = decode_stub(process.address)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.Handoff(iter([decode_pb2.HandoffPart(header=header)]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs a vLLM-backed decode" in refused.value.details()


def test_abort_frees_a_request_and_refuses_a_handoff_that_comes_after_it(decode, prompts: PromptKv) -> None:
    process, _ = decode
    channel, stub = decode_stub(process.address)
    with channel:
        assert not stub.Abort(decode_pb2.AbortRequest(request_id="early", reason="client gone"), timeout=5).found
        _, parts = prompts.handoff("early", padded(prompts, TEXTS[1]), MAX_TOKENS)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Handoff(iter(parts), timeout=60)
        assert refused.value.code() == grpc.StatusCode.ABORTED

        _, parts = prompts.handoff("running", padded(prompts, TEXTS[2]), 200)
        assert stub.Handoff(iter(parts), timeout=60).accepted
        call = stub.StreamTokens(decode_pb2.StreamRequest(request_id="running"), timeout=60)
        next(call)
        assert stub.Abort(decode_pb2.AbortRequest(request_id="running", reason="stop string"), timeout=5).found
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        assert ended.value.code() == grpc.StatusCode.ABORTED
        assert stub.Abort(decode_pb2.AbortRequest(request_id="running"), timeout=5).found is False  # idempotent
    wait_for_kv(process, 0, 2.0)


def test_a_cancelled_stream_frees_its_kv_within_a_second(decode, prompts: PromptKv) -> None:
    process, _ = decode
    channel, stub = decode_stub(process.address)
    with channel:
        _, parts = prompts.handoff("gone", padded(prompts, TEXTS[3]), 200)
        assert stub.Handoff(iter(parts), timeout=60).accepted
        call = stub.StreamTokens(decode_pb2.StreamRequest(request_id="gone"), timeout=60)
        for _ in range(3):
            next(call)
        assert process.kv_used_tokens() > 0
        cancelled_at = time.monotonic()
        call.cancel()
        freed_after = wait_for_kv(process, 0, 5.0) - cancelled_at
    assert freed_after < 1.0, f"KV freed {freed_after:.2f} s after the reader left"


def wait_for_kv(process: DecodeProcess, used: float, timeout_s: float) -> float:
    """When the decode's kv_used gauge reads ``used``."""
    deadline = time.monotonic() + timeout_s
    while process.kv_used_tokens() != used:
        assert time.monotonic() < deadline, f"kv_used stayed at {process.kv_used_tokens()}"
        time.sleep(0.02)
    return time.monotonic()


