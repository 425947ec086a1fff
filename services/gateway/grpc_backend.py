"""The gRPC backend: scheduler ``Place`` → prefill ``Prefill`` stream → decode ``StreamTokens``.

Cancellation is the part that matters for capacity: when the caller stops reading (client gone,
stop string found), every in-flight call is cancelled, and if decode's stream was not opened
yet, it is opened and cancelled at once, which is how decode learns to free the request's slot
and KV without waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc
from crescent.protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from crescent.services.common.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.common.grpc_service import insecure_channel
from crescent.services.gateway.backend import (
    BackendEvent,
    BackendHealth,
    FinishReason,
    FirstToken,
    GenerationRequest,
    MoreTokens,
    RequestId,
)
from crescent.services.gateway.errors import (
    ApiError,
    GatewayTimeoutError,
    InternalError,
    InvalidRequestError,
    RateLimitedError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)

# Rejections that mean "nothing can serve this model now" rather than "too busy".
_UNAVAILABLE_REASONS = {"no_prefill_instance", "no_decode_instance"}
_ABORT_CONFIRM_S = 0.5   # how long an abort waits for decode to see the stream before cancelling
_ABORT_WINDOW_S = 2.0    # how long an abort keeps trying while decode does not know the request yet
_ABORT_RETRY_S = 0.1
_RETRY_AFTER_S = 1.0
_OUTCOME_TIMEOUT_S = 2.0  # ReportOutcome is best effort: metrics only


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> ApiError:
    """Map a failed call to the error a client should see."""
    code = exc.code()
    details = exc.details() or (code.name if code is not None else "unknown error")
    message = f"{what} failed: {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServiceUnavailableError(f"{what} is unavailable: {details}", retry_after_s=_RETRY_AFTER_S)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeoutError(f"{what} did not answer in time")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimitedError(message, retry_after_s=_RETRY_AFTER_S)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequestError(message)
    return InternalError(message)


def _finish_reason(value: str) -> FinishReason:
    if value not in ("stop", "length"):
        raise InternalError(f"backend sent an unknown finish reason {value!r}")
    return value  # type: ignore[return-value]


class GrpcBackend:
    def __init__(self, scheduler_address: str, *, request_timeout_s: float, place_timeout_s: float,
                 health_timeout_s: float, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        self._outcomes: set[asyncio.Task[None]] = set()   # ReportOutcome calls and finishing prefills
        self._block_size = block_size
        self._request_timeout_s = request_timeout_s
        self._place_timeout_s = place_timeout_s
        self._health_timeout_s = health_timeout_s
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel(scheduler_address))

    def _channel(self, address: str) -> grpc.aio.Channel:
        # One channel per instance for the life of the gateway: HTTP/2 multiplexes the requests.
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

    async def health(self) -> BackendHealth:
        try:
            reply = await self._scheduler.ListInstances(
                scheduler_pb2.ListInstancesRequest(), timeout=self._health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "the scheduler") from exc
        roles = [status.info.role for status in reply.instances]
        return BackendHealth(
            prefill_instances=roles.count(scheduler_pb2.INSTANCE_ROLE_PREFILL),
            decode_instances=roles.count(scheduler_pb2.INSTANCE_ROLE_DECODE),
        )

    async def _place(self, request: GenerationRequest) -> scheduler_pb2.Placement:
        try:
            placement = await self._scheduler.Place(
                scheduler_pb2.PlaceRequest(
                    request_id=request.request_id,
                    model_id=request.model_id,
                    block_keys=list(request.block_keys),
                    prompt_tokens=len(request.prompt_token_ids),
                    max_tokens=request.sampling.max_tokens,
                ),
                timeout=self._place_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "the scheduler") from exc
        if placement.HasField("rejection"):
            rejection = placement.rejection
            message = f"rejected by the scheduler ({rejection.reason}): {rejection.message}"
            error_type = ServiceUnavailableError if rejection.reason in _UNAVAILABLE_REASONS else RateLimitedError
            raise error_type(message, retry_after_s=rejection.retry_after_s)
        if not placement.prefill.address or not placement.decode.address:
            raise InternalError("the scheduler returned a placement without addresses")
        return placement

    def _prefill_request(self, request: GenerationRequest, placement: scheduler_pb2.Placement) -> prefill_pb2.PrefillRequest:
        s = request.sampling
        return prefill_pb2.PrefillRequest(
            request_id=request.request_id,
            model_id=request.model_id,
            token_ids=list(request.prompt_token_ids),
            cache_salt=request.cache_salt,
            sampling=common_pb2.SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                has_seed=s.seed is not None, seed=s.seed or 0,
                max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
            ),
            decode_address=placement.decode.address,
            # Hot-prefix replication: the chosen prefill pulls a longer prefix from this source and keeps it.
            prefix_source_id=placement.prefix_source_id,
            prefix_source_blocks=placement.prefix_source_blocks,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._request_timeout_s
        placement = await self._place(request)
        decode_address = placement.decode.address
        prefill_call = prefill_pb2_grpc.PrefillStub(self._channel(placement.prefill.address)).Prefill(
            self._prefill_request(request, placement), timeout=max(deadline - loop.time(), 0.001)
        )
        stream_call = None
        finished = False
        stage = f"prefill at {placement.prefill.address}"
        try:
            first = await prefill_call.read()
            if first is grpc.aio.EOF or first.WhichOneof("event") != "first_token":
                raise InternalError(f"{stage} did not send a first token")
            token = first.first_token
            finished = token.finished
            self._report_outcome(request.request_id, loop.time() - started, token.cached_tokens)
            yield FirstToken(
                token_id=token.token_id,
                prompt_tokens=token.prompt_tokens,
                cached_tokens=token.cached_tokens,
                finish_reason=_finish_reason(token.finish_reason) if token.finished else None,
            )
            if finished:
                return
            handed = await prefill_call.read()
            if handed is grpc.aio.EOF or handed.WhichOneof("event") != "handed_off":
                raise InternalError(f"{stage} did not hand the request off")
            decode_address = handed.handed_off.decode_address or decode_address
            stage = f"decode at {decode_address}"
            stream_call = decode_pb2_grpc.DecodeStub(self._channel(decode_address)).StreamTokens(
                decode_pb2.StreamRequest(request_id=request.request_id),
                timeout=max(deadline - loop.time(), 0.001),
            )
            async for event in stream_call:
                finished = event.finished
                yield MoreTokens(
                    token_ids=tuple(event.token_ids),
                    finish_reason=_finish_reason(event.finish_reason) if event.finished else None,
                )
                if finished:
                    return
            raise InternalError(f"{stage} ended the stream before the request finished")
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, stage) from exc
        finally:
            # No awaits here: this runs inside a cancelled task when the client went away.
            if finished and stream_call is None:
                self._let_prefill_finish(prefill_call)
            else:
                prefill_call.cancel()
            if stream_call is not None:
                stream_call.cancel()
            elif not finished:
                self._abort_in_decode(decode_address, request.request_id)

    def _let_prefill_finish(self, call: grpc.aio.UnaryStreamCall) -> None:
        """A request that ended at its first token: prefill still writes the prompt's blocks to
        the kvstore after sending it, so read its stream to the end instead of cancelling it."""

        async def drain() -> None:
            try:
                while await call.read() is not grpc.aio.EOF:  # read(), not async for: the two styles do not mix
                    pass
            except grpc.aio.AioRpcError as exc:
                log.debug("prefill stream after the last token ended with %s", exc.code().name)

        task = asyncio.get_running_loop().create_task(drain())
        self._outcomes.add(task)
        task.add_done_callback(self._outcomes.discard)

    def _report_outcome(self, request_id: RequestId, ttft_s: float, cached_tokens: int) -> None:
        """Tell the scheduler the measured TTFT (predicted-vs-actual metrics), without delaying the stream."""
        outcome = scheduler_pb2.RequestOutcome(request_id=request_id, ttft_s=ttft_s,
                                               cached_blocks=cached_tokens // self._block_size)
        task = asyncio.get_running_loop().create_task(self._send_outcome(outcome))
        self._outcomes.add(task)
        task.add_done_callback(self._outcomes.discard)

    async def _send_outcome(self, outcome: scheduler_pb2.RequestOutcome) -> None:
        try:
            await self._scheduler.ReportOutcome(outcome, timeout=_OUTCOME_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("could not report the outcome of %s: %s", outcome.request_id, exc.code().name)

    def _abort_in_decode(self, address: str, request_id: RequestId) -> None:
        task = asyncio.get_running_loop().create_task(self._open_and_cancel(address, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _open_and_cancel(self, address: str, request_id: RequestId) -> None:
        """Open decode's stream for a request nobody will read, and cancel it: decode frees it.

        A handoff may still be landing when the client leaves during prefill; while decode says
        it does not know the request, try again for a short while.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _ABORT_WINDOW_S
        while True:
            call = decode_pb2_grpc.DecodeStub(self._channel(address)).StreamTokens(
                decode_pb2.StreamRequest(request_id=request_id), timeout=_ABORT_WINDOW_S + _ABORT_CONFIRM_S
            )
            try:
                # Wait until decode has the call (its initial metadata), so the cancel reaches a live handler.
                await asyncio.wait_for(call.initial_metadata(), _ABORT_CONFIRM_S)
                unknown = call.done() and await call.code() == grpc.StatusCode.NOT_FOUND
            except (TimeoutError, grpc.aio.AioRpcError):
                unknown = False
            finally:
                call.cancel()
            if not unknown:
                log.info("aborted %s in decode at %s", request_id, address)
                return
            if loop.time() >= give_up:
                log.info("decode at %s never received %s; nothing to abort", address, request_id)
                return
            await asyncio.sleep(_ABORT_RETRY_S)

    async def close(self) -> None:
        if self._aborts or self._outcomes:
            await asyncio.wait(self._aborts | self._outcomes, timeout=_ABORT_WINDOW_S + _ABORT_CONFIRM_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
