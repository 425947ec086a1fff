"""The gRPC backend: placement attempts (``attempt``) chained by request migration (``migration``);
the ``n`` choices of a prompt share one placement (``choice_group``).

This module owns what outlives one request: a channel per instance, the model's block size as
the scheduler's instances report it (one source of truth: the gateway's own ``block_size``
setting only stands in until the scheduler has told it), and the fire-and-forget calls a
finished attempt leaves behind (``Abort`` to decode, ``ReportOutcome`` to the scheduler).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import grpc
from crescent.protos import decode_pb2, decode_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE, prefix_block_keys
from crescent.services.common.grpc_service import GRPC_OPTIONS, open_channel
from crescent.services.common.settings import load_settings
from crescent.services.common.tls import PeerTls, TlsSettings, load_tls
from crescent.services.gateway.attempts.attempt import AttemptRequest, PlaceFailed, run_attempt
from crescent.services.gateway.backend import BackendEvent, BackendHealth, GenerationRequest, RequestId
from crescent.services.gateway.attempts.choice_group import choice_streams
from crescent.services.gateway.errors import (
    ApiError,
    GatewayTimeoutError,
    InternalError,
    InvalidRequestError,
    RateLimitedError,
    ServiceUnavailableError,
)
from crescent.services.gateway.attempts.migration import MigrationPolicy, generate_with_migration, migrations_counter

log = logging.getLogger(__name__)

# Rejections that mean "nothing can serve this model now" rather than "too busy".
_UNAVAILABLE_REASONS = {"no_prefill_instance", "no_decode_instance"}
# Rejections no retry can fix: the request is larger than any instance can ever hold.
_NEVER_FITS_REASONS = {"exceeds_kv_capacity"}
_ENGINE_ROLES = (scheduler_pb2.INSTANCE_ROLE_PREFILL, scheduler_pb2.INSTANCE_ROLE_DECODE,
                 scheduler_pb2.INSTANCE_ROLE_AGGREGATED, scheduler_pb2.INSTANCE_ROLE_KVSTORE)
_RETRY_AFTER_S = 1.0
_CALL_TIMEOUT_S = 2.0     # Abort and ReportOutcome: best effort
_CLOSE_WAIT_S = 1.0       # how long close() lets those calls finish (the drain's exit margin is 5 s)
# gRPC's reconnect backoff grows to 120 s by default: a restarted scheduler (or an instance back
# on its address) would stay unreachable from here that long. Retry connections every second.
_CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
# The gateway's certificate for its gRPC channels (docs/security.md), from
# CRESCENT_GATEWAY_TLS__CA / __CERT / __KEY (__SERVER_NAME): unset, the channels are plaintext.
TLS_ENV_PREFIX = "CRESCENT_GATEWAY_TLS"


def gateway_tls() -> PeerTls | None:
    """The gateway's key pair for mutual TLS to the other services, from the environment."""
    return load_tls(load_settings(TlsSettings, env_prefix=TLS_ENV_PREFIX))


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> ApiError:
    """Map a failed call to the error a client should see: a plain message; gRPC's detail
    (addresses, connection errors) goes to the log, under the request id."""
    code = exc.code()
    name = code.name if code is not None else "UNKNOWN"
    log.warning("%s failed: %s: %s", what, name, exc.details())
    # CANCELLED here is the server's: one stopping (SIGTERM past its grace) cancels the calls it
    # still holds. The gateway's own cancellations arrive as asyncio.CancelledError, never here.
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return ServiceUnavailableError(f"{what} is unavailable; retry later", retry_after_s=_RETRY_AFTER_S)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeoutError(f"{what} did not answer in time")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimitedError(f"{what} is out of capacity; retry later", retry_after_s=_RETRY_AFTER_S)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        # Our own services' refusals of the request: their text is written for the client.
        return InvalidRequestError(f"{what} refused the request: {exc.details()}")
    return InternalError(f"{what} failed ({name})")


class GrpcBackend:
    def __init__(self, scheduler_address: str, *, request_timeout_s: float, place_timeout_s: float,
                 health_timeout_s: float, block_size: int | None = None, model_id: str | None = None,
                 migration: MigrationPolicy = MigrationPolicy(), tls: PeerTls | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task[None]] = set()  # Abort, ReportOutcome, finishing prefills
        self._configured_block_size = block_size
        self._model_id = model_id  # /health counts this model's instances (None: every instance)
        self._block_sizes: dict[str, int] = {}             # model id -> what its instances use
        self._request_timeout_s = request_timeout_s
        self._place_timeout_s = place_timeout_s
        self._health_timeout_s = health_timeout_s
        self._migration = migration
        migrations_counter()  # on /metrics before the first migration
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel(scheduler_address))

    def channel(self, address: str) -> grpc.aio.Channel:
        # One channel per instance for the life of the gateway: HTTP/2 multiplexes the requests.
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls, _CHANNEL_OPTIONS)
        return channel

    # -- the scheduler's view: health and the model's block size ---------------------------------

    async def _list_instances(self) -> scheduler_pb2.ListInstancesReply:
        try:
            reply = await self._scheduler.ListInstances(scheduler_pb2.ListInstancesRequest(),
                                                        timeout=self._health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "the scheduler") from exc
        self._learn_block_sizes(reply)
        return reply

    def _learn_block_sizes(self, reply: scheduler_pb2.ListInstancesReply) -> None:
        for status in reply.instances:
            info = status.info
            if info.role not in _ENGINE_ROLES or info.block_size <= 0 or not info.model_id:
                continue
            known = self._block_sizes.get(info.model_id)
            if known == info.block_size:
                continue
            self._block_sizes[info.model_id] = info.block_size
            configured = self._configured_block_size
            if configured is not None and configured != info.block_size:
                log.error("the gateway's block_size setting is %d but %s's instances use %d: using %d "
                          "(remove the setting; the scheduler's instances are the source of truth)",
                          configured, info.model_id, info.block_size, info.block_size)
            else:
                log.info("model %s uses %d-token blocks", info.model_id, info.block_size)

    async def health(self) -> BackendHealth:
        reply = await self._list_instances()
        roles = [status.info.role for status in reply.instances
                 if self._model_id is None or status.info.model_id in (self._model_id, "")]
        both = roles.count(scheduler_pb2.INSTANCE_ROLE_AGGREGATED)  # an aggregated instance is either
        return BackendHealth(
            prefill_instances=roles.count(scheduler_pb2.INSTANCE_ROLE_PREFILL) + both,
            decode_instances=roles.count(scheduler_pb2.INSTANCE_ROLE_DECODE) + both,
        )

    async def _block_size(self, model_id: str) -> int:
        if model_id not in self._block_sizes:
            try:
                await self._list_instances()
            except ApiError as exc:
                log.debug("could not ask the scheduler for the block size: %s", exc.message)
        return self._block_sizes.get(model_id) or self._configured_block_size or DEFAULT_BLOCK_SIZE

    # -- one attempt's calls (attempt.AttemptCalls) -----------------------------------------------

    async def place(self, request: AttemptRequest, deadline: float) -> scheduler_pb2.Placement:
        block_size = await self._block_size(request.model_id)
        try:
            placement = await self._place_with(request, block_size, deadline)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise PlaceFailed(rpc_error(exc, "the scheduler")) from exc
            # The model's block size changed (or was never learned): ask again, and retry once.
            self._block_sizes.pop(request.model_id, None)
            if await self._block_size(request.model_id) == block_size:
                raise PlaceFailed(rpc_error(exc, "the scheduler")) from exc
            try:
                placement = await self._place_with(request, await self._block_size(request.model_id), deadline)
            except grpc.aio.AioRpcError as again:
                raise PlaceFailed(rpc_error(again, "the scheduler")) from again
        if placement.HasField("rejection"):
            rejection = placement.rejection
            message = f"rejected by the scheduler ({rejection.reason}): {rejection.message}"
            if rejection.reason in _NEVER_FITS_REASONS:  # waiting cannot help: the client must ask for less
                raise PlaceFailed(InvalidRequestError(message, code=rejection.reason))
            error_type = ServiceUnavailableError if rejection.reason in _UNAVAILABLE_REASONS else RateLimitedError
            raise PlaceFailed(error_type(message, retry_after_s=rejection.retry_after_s))
        if not placement.prefill.address or not placement.decode.address:
            raise PlaceFailed(InternalError("the scheduler returned a placement without addresses"))
        return placement

    async def _place_with(self, request: AttemptRequest, block_size: int, deadline: float) -> scheduler_pb2.Placement:
        keys = prefix_block_keys(request.token_ids, block_size, request.model_id, request.cache_salt)
        timeout = max(min(self._place_timeout_s, deadline - asyncio.get_running_loop().time()), 0.001)
        return await self._scheduler.Place(
            scheduler_pb2.PlaceRequest(
                request_id=request.attempt_id, model_id=request.model_id, block_keys=keys,
                prompt_tokens=len(request.token_ids), max_tokens=request.sampling.max_tokens,
                block_size=block_size, n=request.sampling.n, unreachable_instance_ids=list(request.unreachable),
            ),
            timeout=timeout,
        )

    def report_outcome(self, request: AttemptRequest, *, ttft_s: float = 0.0, cached_tokens: int = 0,
                       released: bool = False, output_tokens: int = 0) -> asyncio.Future[None]:
        """Tell the scheduler the measured TTFT, and whether the request will not reach decode;
        ``output_tokens`` > 0: it finished at decode after generating that many. The future is
        done once the scheduler has the report or the call failed."""
        block_size = self._block_sizes.get(request.model_id) or self._configured_block_size or DEFAULT_BLOCK_SIZE
        outcome = scheduler_pb2.RequestOutcome(request_id=request.attempt_id, ttft_s=ttft_s,
                                               cached_blocks=cached_tokens // block_size, released=released,
                                               finished=output_tokens > 0, output_tokens=output_tokens)
        return self._in_background(self._send_outcome(outcome))

    async def _send_outcome(self, outcome: scheduler_pb2.RequestOutcome) -> None:
        try:
            await self._scheduler.ReportOutcome(outcome, timeout=_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("could not report the outcome of %s: %s", outcome.request_id, exc.code().name)

    def abort_in_decode(self, address: str, attempt_id: RequestId, reason: str, *,
                        index: int | None = None) -> None:
        """``index``: end only that choice of the request; None: the whole request."""
        request = decode_pb2.AbortRequest(request_id=attempt_id, reason=reason, one_choice=index is not None,
                                          index=index or 0)
        self._in_background(self._abort(address, request))

    async def _abort(self, address: str, request: decode_pb2.AbortRequest) -> None:
        what = f"choice {request.index} of {request.request_id}" if request.one_choice else request.request_id
        try:
            reply = await decode_pb2_grpc.DecodeStub(self.channel(address)).Abort(request, timeout=_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.info("could not abort %s in decode at %s: %s", what, address, exc.code().name)
            return
        log.info("aborted %s in decode at %s (%s; %s)", what, address, request.reason,
                 "it held the request" if reply.found else "not there yet: a late handoff will be refused")

    def let_prefill_finish(self, call: grpc.aio.UnaryStreamCall) -> None:
        """A request that ended at its first token: prefill still writes the prompt's blocks to
        the kvstore after sending it, so read its stream to the end instead of cancelling it."""

        async def drain() -> None:
            try:
                while await call.read() is not grpc.aio.EOF:  # read(), not async for: the two styles do not mix
                    pass
            except grpc.aio.AioRpcError as exc:
                log.debug("prefill stream after the last token ended with %s", exc.code().name)

        self._in_background(drain())

    def _in_background(self, work: object) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- the request ------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout_s
        return generate_with_migration(
            request, lambda attempt: run_attempt(self, attempt, deadline, loop.time),
            deadline=deadline, clock=loop.time, policy=self._migration,
        )

    def generate_choices(self, request: GenerationRequest, n: int) -> list[AsyncGenerator[BackendEvent, None]]:
        if n == 1:
            return [self.generate(request)]
        loop = asyncio.get_running_loop()
        return choice_streams(self, request, n, deadline=loop.time() + self._request_timeout_s, clock=loop.time,
                              policy=self._migration)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=_CLOSE_WAIT_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
