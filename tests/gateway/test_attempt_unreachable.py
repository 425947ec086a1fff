"""Which instance an attempt's UNAVAILABLE blames: the one the next placement reports unreachable."""

from __future__ import annotations

import grpc
from crescent.protos import scheduler_pb2
from crescent.services.gateway.attempts.attempt import AttemptFailed, _failure, _unreachable

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
