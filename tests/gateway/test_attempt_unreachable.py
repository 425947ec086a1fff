"""Which instance an attempt's UNAVAILABLE blames (the one the next placement reports unreachable),
how an attempt calls an instance restarted on the address its channel lost, and what a client
hears when the scheduler goes away mid-call."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from crescent.protos import scheduler_pb2
from crescent.services.gateway.attempts.attempt import (
    RECONNECT_WAIT_S,
    AttemptFailed,
    _failure,
    _unreachable,
    reconnected,
)
from crescent.services.gateway.attempts.grpc_backend import _CHANNEL_OPTIONS
from crescent.services.gateway.attempts.grpc_backend import rpc_error as rpc_error_of_the_gateway
from crescent.services.gateway.errors import ServiceUnavailableError
from tests.ports import free_port

PLACEMENT = scheduler_pb2.Placement(
    prefill=scheduler_pb2.InstanceRef(instance_id="prefill-0", address="127.0.0.1:1"),
    decode=scheduler_pb2.InstanceRef(instance_id="decode-1", address="127.0.0.1:2"),
)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_broken_decode_stream_blames_decode() -> None:
    exc = rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    failure = _failure(exc, "decode at 127.0.0.1:2", before_first_token=False,
                       unreachable=_unreachable(exc, PLACEMENT, at_decode=True))
    assert isinstance(failure, AttemptFailed) and failure.unreachable == "decode-1"


def test_prefill_failing_its_handoff_blames_decode_and_a_refused_prefill_blames_prefill() -> None:
    # services/prefill/servicer.py ends the call this way when the decode it hands off to is gone.
    handoff = rpc_error(grpc.StatusCode.UNAVAILABLE,
                        "handoff to decode 127.0.0.1:2 failed: UNAVAILABLE: failed to connect to all addresses")
    assert _unreachable(handoff, PLACEMENT, at_decode=False) == "decode-1"
    refused = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    assert _unreachable(refused, PLACEMENT, at_decode=False) == "prefill-0"


def test_only_unavailable_names_an_unreachable_instance() -> None:
    exc = rpc_error(grpc.StatusCode.INTERNAL, "a bug")
    failure = _failure(exc, "decode at 127.0.0.1:2", before_first_token=False,
                       unreachable=_unreachable(exc, PLACEMENT, at_decode=True))
    assert isinstance(failure, AttemptFailed) and failure.unreachable == ""



# -- an instance restarted on its address (the fault suite's killed decode came back on its port) --

async def _health_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _channel_that_lost_its_instance() -> tuple[grpc.aio.Channel, int]:
    """A channel with the gateway's reconnect options whose instance died a while ago: in
    reconnect backoff (TRANSIENT_FAILURE), where gRPC fails calls at once without trying."""
    port = free_port()
    server = await _health_server(port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)
    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    await server.stop(None)
    failed_calls = 0
    deadline = time.monotonic() + 20
    while failed_calls < 4 or channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        assert time.monotonic() < deadline, f"the channel never saw its instance gone: {channel.get_state()}"
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            failed_calls += 1  # each failed reconnect doubles the backoff, towards its 1 s cap
        await asyncio.sleep(0.2)
    return channel, port


async def test_a_call_to_an_instance_restarted_on_its_address_waits_for_the_channel_instead_of_failing() -> None:
    channel, port = await _channel_that_lost_its_instance()
    server = await _health_server(port)  # the supervisor restarted it, on the same port
    try:
        # Still in backoff: a call now would fail at once with the dead instance's error though the
        # new one listens (what cost the fault suite's health probe a re-placement).
        assert channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
        started = time.monotonic()
        await reconnected(channel)
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < RECONNECT_WAIT_S + 1
    finally:
        await server.stop(None)
        await channel.close()


async def test_the_wait_for_a_channel_whose_instance_stays_down_is_bounded() -> None:
    channel, _ = await _channel_that_lost_its_instance()
    try:
        started = time.monotonic()
        await reconnected(channel, timeout_s=0.5)
        assert time.monotonic() - started < 3
        with pytest.raises(grpc.aio.AioRpcError) as failed:  # the attempt fails and the request moves
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_scheduler_gone_or_stopping_mid_call_is_a_503_with_retry_after(code: grpc.StatusCode) -> None:
    # A scheduler stopped by SIGTERM cancels the Place calls it still holds (the fault suite saw
    # one such request answered 500 "the scheduler failed (CANCELLED)").
    error = rpc_error_of_the_gateway(rpc_error(code, "server shutting down"), "the scheduler")
    assert isinstance(error, ServiceUnavailableError) and error.retry_after_s, error
