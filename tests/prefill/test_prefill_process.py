"""A real prefill process: a handoff that fails, a migrated request's first token, a drain.

What a user would notice: when decode is gone, the first token still arrives and the call then
ends with UNAVAILABLE (the gateway places the request again) without leaking the prompt's
pages; a migrated seeded request continues the same random stream; SIGTERM lets the prompt in
progress finish, refuses new ones and exits 0.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from crescent.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.contract.choices import choice_seed
from crescent.services.engine.sampler import SamplingConfig
from tests.decode.process import TEXTS as SHARED_TEXTS, BLOCK, DecodeProcess, PromptKv, SchedulerStandIn
from tests.ports import free_port

pytestmark = pytest.mark.slow  # real processes: a model load each

TEXTS = SHARED_TEXTS[:3]


@pytest.fixture(scope="module")
def prompts() -> PromptKv:
    return PromptKv()


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory):
    scheduler = SchedulerStandIn()
    process = DecodeProcess(tmp_path_factory.mktemp("prefill"), scheduler.address, 4 * BLOCK, role="prefill")
    try:
        process.start()
        yield process, scheduler.servicer
    finally:
        process.stop()
        scheduler.stop()


def call_prefill(address: str, request_id: str, tokens: list[int], sampling: common_pb2.SamplingParams,
                 decode_address: str = "") -> tuple[list[prefill_pb2.PrefillEvent], grpc.RpcError | None]:
    events = []
    with grpc.insecure_channel(address) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            for event in stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, token_ids=tokens, sampling=sampling, decode_address=decode_address,
            ), timeout=120):
                events.append(event)
        except grpc.RpcError as exc:
            return events, exc
    return events, None


def test_a_failed_handoff_ends_with_unavailable_after_the_first_token_and_frees_the_pages(prefill, prompts) -> None:
    process, scheduler = prefill
    dead_decode = f"127.0.0.1:{free_port()}"
    sampling = common_pb2.SamplingParams(max_tokens=20, ignore_eos=True)
    for i, text in enumerate(TEXTS):  # each needs 3 of the 4 pages: a leak would fail the next one
        tokens = prompts.prompt(text * 3)[: 2 * BLOCK + 10]
        events, error = call_prefill(process.address, f"h{i}", tokens, sampling, dead_decode)
        assert [e.WhichOneof("event") for e in events] == ["first_token"]
        assert events[0].first_token.token_id == prompts.reference(tokens, 1)[0]
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert dead_decode in error.details()
    deadline = time.monotonic() + 5
    while not {"h0", "h1", "h2"} <= scheduler.finished_ids():
        assert time.monotonic() < deadline, "the scheduler should hear that the requests left"
        time.sleep(0.05)


def test_a_migrated_seeded_request_continues_at_first_step(prefill, prompts) -> None:
    process, _ = prefill
    tokens = prompts.prompt(TEXTS[0])
    original = prompts.engine.generate(tokens, 8, SamplingConfig(temperature=1.0, seed=3), stop_token_ids=[])
    done = 5
    sampling = common_pb2.SamplingParams(temperature=1.0, has_seed=True, seed=3, max_tokens=1, ignore_eos=True,
                                         first_step=done)
    events, error = call_prefill(process.address, "moved", tokens + original[:done], sampling)
    assert error is None
    assert events[0].first_token.token_id == original[done]
    assert events[0].first_token.finished and events[0].first_token.finish_reason == "length"


def test_n_choices_get_their_first_tokens_from_one_prefill_each_with_its_seed(prefill, prompts) -> None:
    process, _ = prefill
    tokens = prompts.prompt(TEXTS[1])
    expected = [prompts.engine.generate(tokens, 1, SamplingConfig(temperature=1.0, seed=choice_seed(3, i)),
                                        stop_token_ids=[])[0] for i in range(3)]
    sampling = common_pb2.SamplingParams(temperature=1.0, has_seed=True, seed=3, max_tokens=1, ignore_eos=True, n=3)
    events, error = call_prefill(process.address, "n3", tokens, sampling)
    assert error is None  # every choice ended at its first token: no handoff
    firsts = [e.first_token for e in events]
    assert [f.index for f in firsts] == [0, 1, 2]
    assert [f.token_id for f in firsts] == expected
    assert all(f.finished and f.finish_reason == "length" and f.prompt_tokens == len(tokens) for f in firsts)

    for bad in (common_pb2.SamplingParams(max_tokens=1, n=17),
                common_pb2.SamplingParams(max_tokens=1, n=2, first_step=2)):  # a migration continues one choice
        events, error = call_prefill(process.address, "bad-n", tokens, bad)
        assert not events and error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_finishes_the_prompt_in_progress_refuses_new_ones_and_exits_zero(tmp_path, prompts) -> None:
    scheduler = SchedulerStandIn()
    process = DecodeProcess(tmp_path, scheduler.address, 2048, role="prefill")
    try:
        process.start()
        long_prompt = prompts.prompt(" ".join(TEXTS) * 12)[:1500]
        result: dict[str, object] = {}
        sampling = common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)
        caller = threading.Thread(target=lambda: result.update(
            zip(("events", "error"), call_prefill(process.address, "long", long_prompt, sampling))))
        caller.start()
        time.sleep(0.5)  # the prompt is being computed
        process.terminate()
        time.sleep(0.2)
        _, refused = call_prefill(process.address, "late", long_prompt[:10], sampling)
        assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.details()
        caller.join(60)
        assert result["error"] is None and result["events"][0].first_token.finished
        assert process.proc.wait(30) == 0
        assert scheduler.servicer.deregistered
    finally:
        process.stop()
        scheduler.stop()
