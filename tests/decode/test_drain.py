"""A decode process's lifecycle: SIGTERM drains, a second one or the end of the grace ends what is
left with UNAVAILABLE "decode draining" (the gateway migrates those), a refused registration
exits non-zero with the scheduler's reason."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from crescent.protos import decode_pb2
from tests.decode.process import BLOCK, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub

pytestmark = pytest.mark.slow  # real processes: a model load each

TEXT = "The lighthouse keeper counted the ships that passed the rocky point every night, and he wrote"


@pytest.fixture(scope="module")
def prompts() -> PromptKv:
    return PromptKv()


@pytest.fixture
def scheduler():
    stand_in = SchedulerStandIn()
    yield stand_in
    stand_in.stop()


def start_decode(tmp_path, scheduler: SchedulerStandIn, **settings) -> DecodeProcess:
    process = DecodeProcess(tmp_path, scheduler.address, 16 * BLOCK, **settings)
    process.start()
    return process


class Reader(threading.Thread):
    """Streams one request's tokens; keeps them and the error the stream ended with."""

    def __init__(self, address: str, request_id: str) -> None:
        super().__init__()
        self.address, self.request_id = address, request_id
        self.tokens: list[int] = []
        self.reason = ""
        self.error: grpc.RpcError | None = None
        self.started_streaming = threading.Event()
        self.ended_at = 0.0

    def run(self) -> None:
        channel, stub = decode_stub(self.address)
        with channel:
            try:
                for event in stub.StreamTokens(decode_pb2.StreamRequest(request_id=self.request_id), timeout=120):
                    self.tokens.extend(event.token_ids)
                    self.reason = event.finish_reason or self.reason
                    self.started_streaming.set()
            except grpc.RpcError as exc:
                self.error = exc
            finally:
                self.ended_at = time.monotonic()
                self.started_streaming.set()


def hand_off(process: DecodeProcess, prompts: PromptKv, request_id: str, tokens: list[int], max_tokens: int) -> int:
    first, parts = prompts.handoff(request_id, tokens, max_tokens)
    channel, stub = decode_stub(process.address)
    with channel:
        assert stub.Handoff(iter(parts), timeout=60).accepted
    return first


def test_sigterm_drains_in_flight_streams_to_completion_and_exits_zero(tmp_path, scheduler, prompts) -> None:
    process = start_decode(tmp_path, scheduler)
    try:
        tokens = prompts.prompt(TEXT)
        first = hand_off(process, prompts, "inflight", tokens, 48)
        reader = Reader(process.address, "inflight")
        reader.start()
        reader.started_streaming.wait(30)
        process.terminate()
        deadline = time.monotonic() + 1.0
        while process.health_status() != 503:
            assert time.monotonic() < deadline, "/health should answer 503 at once when draining"
            time.sleep(0.02)
        _, parts = prompts.handoff("late", tokens, 8)
        channel, stub = decode_stub(process.address)
        with channel, pytest.raises(grpc.RpcError) as refused:
            stub.Handoff(iter(parts), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        reader.join(60)
        assert reader.error is None and reader.reason == "length"
        assert [first, *reader.tokens] == prompts.reference(tokens, 48)
        assert process.proc.wait(30) == 0
        assert scheduler.servicer.deregistered, "a draining instance leaves placement"
    finally:
        process.stop()


@pytest.mark.parametrize("cut", ["grace", "second_signal"])
def test_what_is_left_ends_with_decode_draining(tmp_path, scheduler, prompts, cut: str) -> None:
    process = start_decode(tmp_path, scheduler, drain_grace_s=1.0 if cut == "grace" else 100.0)
    try:
        tokens = prompts.prompt(TEXT)
        first = hand_off(process, prompts, "long", tokens, 16 * BLOCK - len(tokens))
        reader = Reader(process.address, "long")
        reader.start()
        reader.started_streaming.wait(30)
        signalled_at = time.monotonic()
        process.terminate()
        if cut == "second_signal":
            time.sleep(0.3)
            process.terminate()
        reader.join(30)
        assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE
        assert reader.error.details() == "decode draining"
        assert reader.ended_at - signalled_at < 3.0
        assert tokens and [first, *reader.tokens] == prompts.reference(tokens, 1 + len(reader.tokens)), \
            "every token sent before the end is right, so the gateway can continue from there"
        assert process.proc.wait(30) == 0
    finally:
        process.stop()


def test_a_refused_registration_exits_non_zero_with_the_reason(tmp_path) -> None:
    reason = "kv_format paged-v1:1x2x3 differs from the model's paged-v1:4x5x6"
    refusing = SchedulerStandIn(refuse=reason)
    process = DecodeProcess(tmp_path, refusing.address, 4 * BLOCK)
    try:
        process.start(wait_ready=False)
        assert process.proc.wait(120) != 0
        log = process.log.read_text(errors="replace")
        assert "ERROR" in log and reason in log
    finally:
        process.stop()
        refusing.stop()
