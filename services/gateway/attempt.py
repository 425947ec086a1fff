"""One placement attempt of a request: scheduler ``Place`` → prefill ``Prefill`` → decode ``StreamTokens``.

An attempt either finishes the request, or fails with ``AttemptFailed`` when another placement
may get past the failure (an instance died, drained, or lost its connection), or raises an
``ApiError`` when nothing else can help (the client's request is bad, the deadline passed). The
caller (``migration``) decides whether to place the request again.

However an attempt ends short of its finish (failure, client gone, stop string), it cleans up
without awaiting, because it may run inside a cancelled task: its calls are cancelled, decode
is told to ``Abort`` it (one best-effort call: decode keeps a tombstone for an id it does not
hold yet, so a handoff still in flight is refused), and a request that never reached decode is
reported ``released`` so the scheduler frees what it reserved for it there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, scheduler_pb2
from crescent.services.gateway.backend import (
    BackendEvent,
    FinishReason,
    FirstToken,
    MoreTokens,
    RequestId,
    TokenLogprob,
)
from crescent.services.gateway.errors import ApiError, GatewayTimeoutError, InternalError, InvalidRequestError

log = logging.getLogger(__name__)

# Errors that are the request's fault: placing it elsewhere would fail the same way.
_CLIENT_FAULT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


@dataclass(frozen=True, slots=True)
class AttemptRequest:
    """What one placement serves: the prompt, plus every token the client already has."""

    attempt_id: RequestId          # the request id on the backend; a fresh one per migration
    model_id: str
    token_ids: tuple[int, ...]     # prompt + tokens generated before this attempt
    cache_salt: bytes
    sampling: common_pb2.SamplingParams  # first_step and max_tokens already account for them


class AttemptFailed(Exception):
    """A failure that another placement may get past; ``stage`` says where it happened."""

    def __init__(self, stage: str, message: str, *, before_first_token: bool) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.before_first_token = before_first_token


class PlaceFailed(Exception):
    """The scheduler refused or could not be reached; ``error`` is what a client would see."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class AttemptCalls(Protocol):
    """What an attempt needs from the backend that owns the channels (``GrpcBackend``)."""

    def channel(self, address: str) -> grpc.aio.Channel: ...

    async def place(self, request: AttemptRequest, deadline: float) -> scheduler_pb2.Placement:
        """Raises ``PlaceFailed``."""
        ...

    def report_outcome(self, request: AttemptRequest, *, ttft_s: float = 0.0, cached_tokens: int = 0,
                       released: bool) -> None: ...

    def abort_in_decode(self, address: str, attempt_id: RequestId, reason: str) -> None: ...

    def let_prefill_finish(self, call: grpc.aio.UnaryStreamCall) -> None: ...


def token_logprob(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(message.token_id, message.logprob, tuple((t.token_id, t.logprob) for t in message.top))


def finish_reason(value: str) -> FinishReason:
    if value not in ("stop", "length"):
        raise InternalError(f"backend sent an unknown finish reason {value!r}")
    return value  # type: ignore[return-value]


def _prefill_request(request: AttemptRequest, placement: scheduler_pb2.Placement) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request.attempt_id,
        model_id=request.model_id,
        token_ids=list(request.token_ids),
        cache_salt=request.cache_salt,
        sampling=request.sampling,
        decode_address=placement.decode.address,
        # Hot-prefix replication: the chosen prefill pulls a longer prefix from this source and keeps it.
        prefix_source_id=placement.prefix_source_id,
        prefix_source_blocks=placement.prefix_source_blocks,
        prefix_source_address=placement.prefix_source_address,
    )


def _failure(exc: grpc.aio.AioRpcError, stage: str, *, before_first_token: bool) -> Exception:
    code = exc.code()
    details = exc.details() or (code.name if code is not None else "unknown error")
    role = stage.split(" ", 1)[0]  # the client hears "prefill", not the instance's address
    if code in _CLIENT_FAULT:
        log.info("%s refused the request: %s", stage, details)
        return InvalidRequestError(f"{role} refused the request: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeoutError(f"the request did not finish before its deadline ({role})")
    name = code.name if code is not None else "unknown"
    return AttemptFailed(stage, f"{name}: {details}", before_first_token=before_first_token)


async def run_attempt(calls: AttemptCalls, request: AttemptRequest, deadline: float,
                      clock: Callable[[], float]) -> AsyncGenerator[BackendEvent, None]:
    """Place and serve ``request`` once; see the module docstring for how it ends."""
    started = clock()
    placement = await calls.place(request, deadline)
    decode_address = placement.decode.address
    prefill_call = prefill_pb2_grpc.PrefillStub(calls.channel(placement.prefill.address)).Prefill(
        _prefill_request(request, placement), timeout=max(deadline - clock(), 0.001)
    )
    stream_call = None
    first_seen = handed_off = done = False
    stage = f"prefill at {placement.prefill.address}"
    why = "failed"
    try:
        first = await prefill_call.read()
        if first is grpc.aio.EOF or first.WhichOneof("event") != "first_token":
            raise AttemptFailed(stage, "ended without a first token", before_first_token=True)
        first_seen = True
        token = first.first_token
        done = token.finished
        calls.report_outcome(request, ttft_s=clock() - started, cached_tokens=token.cached_tokens,
                             released=token.finished)
        yield FirstToken(
            token_id=token.token_id,
            prompt_tokens=token.prompt_tokens,
            cached_tokens=token.cached_tokens,
            finish_reason=finish_reason(token.finish_reason) if token.finished else None,
            logprob=token_logprob(token.logprob) if token.HasField("logprob") else None,
        )
        if done:
            return
        handed = await prefill_call.read()
        if handed is grpc.aio.EOF or handed.WhichOneof("event") != "handed_off":
            raise AttemptFailed(stage, "ended without handing the request off", before_first_token=False)
        handed_off = True
        decode_address = handed.handed_off.decode_address or decode_address
        stage = f"decode at {decode_address}"
        stream_call = decode_pb2_grpc.DecodeStub(calls.channel(decode_address)).StreamTokens(
            decode_pb2.StreamRequest(request_id=request.attempt_id), timeout=max(deadline - clock(), 0.001)
        )
        async for event in stream_call:
            done = event.finished
            yield MoreTokens(
                token_ids=tuple(event.token_ids),
                finish_reason=finish_reason(event.finish_reason) if event.finished else None,
                logprobs=tuple(token_logprob(lp) for lp in event.logprobs),
            )
            if done:
                return
        raise AttemptFailed(stage, "ended the stream before the request finished", before_first_token=False)
    except grpc.aio.AioRpcError as exc:
        raise _failure(exc, stage, before_first_token=not first_seen) from exc
    except (asyncio.CancelledError, GeneratorExit):
        why = "cancelled"  # the client went away, or a stop string ended it
        raise
    finally:
        # No awaits here: this runs inside a cancelled task when the client went away.
        if done and stream_call is None:
            calls.let_prefill_finish(prefill_call)  # ended at its first token: prefill still stores the prompt
        else:
            prefill_call.cancel()
        if stream_call is not None:
            stream_call.cancel()
        if not done:
            calls.abort_in_decode(decode_address, request.attempt_id, why)
            if not handed_off:
                calls.report_outcome(request, released=True)
