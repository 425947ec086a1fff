"""One placement attempt of a request: scheduler ``Place`` → prefill ``Prefill`` → decode ``StreamTokens``.

An attempt either finishes the request, or fails with ``AttemptFailed`` when another placement
may get past the failure (an instance died, drained, or lost its connection), or raises an
``ApiError`` when nothing else can help (the client's request is bad, the deadline passed). The
caller (``migration``) decides whether to place the request again.

However an attempt ends short of its finish (failure, client gone, stop string), it cleans up
without awaiting, because it may run inside a cancelled task: its calls are cancelled, decode
is told to ``Abort`` it (one best-effort call: decode keeps a tombstone for an id it does not
hold yet, so a handoff still in flight is refused), and a request that never reached decode is
reported ``released`` so the scheduler frees what it reserved for it there. A request that
finished at decode is reported ``finished`` with the tokens it generated: the scheduler
calibrates when decode KV frees from these (``scheduler/output_lengths.py``). That report goes
out before the client gets its last token, and the attempt waits a moment for it
(``FINISH_REPORT_WAIT_S``): a client that sends its next request as soon as one ends must not
find decode's KV still reserved for the one that ended (a 429 ``decode_kv_full`` that is not true).

An attempt that failed because an instance could not be reached (UNAVAILABLE: a refused
connection, a broken stream, prefill's handoff to a dead decode) names that instance
(``AttemptFailed.unreachable``); the next placement reports it, and the scheduler places
nothing there until it heartbeats again, so a dead instance costs each of its requests one
re-placement instead of one per retry until the scheduler's heartbeat timeout. A restarted
instance comes back on its address, where the gateway's channel may still wait out its reconnect
backoff and fail every call at once: before calling an instance the scheduler or prefill just
vouched for, an attempt gives such a channel a moment to connect (``reconnected``), so the first
request placed on a restarted instance is not wasted and placed again.

One attempt may serve ``n`` choices of the prompt (``sampling.n``, docs/api.md "n > 1"):
prefill sends n first tokens, decode's events name their choice, and a choice whose reader
stopped early is aborted alone (``Abort`` with ``one_choice``); ``choice_group`` gives each
choice its own events. ``run_attempt`` is the one-choice case.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
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
# How prefill's message starts when its handoff to decode failed (services/prefill/servicer.py):
# an UNAVAILABLE with it is the decode instance's, not prefill's.
HANDOFF_FAILED = "handoff to decode "
# How long a call waits for a channel in reconnect backoff (the gateway's backoff is at most 1 s
# plus jitter): longer, and the instance is down after all; the call fails and the request moves.
RECONNECT_WAIT_S = 2.0
# How long the last token waits for the scheduler to have the finish report (a loopback RPC takes
# milliseconds); a scheduler slower than this gets the report in the background, as before.
FINISH_REPORT_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class AttemptRequest:
    """What one placement serves: the prompt, plus every token the client already has."""

    attempt_id: RequestId          # the request id on the backend; a fresh one per migration
    model_id: str
    token_ids: tuple[int, ...]     # prompt + tokens generated before this attempt
    cache_salt: bytes
    sampling: common_pb2.SamplingParams  # first_step and max_tokens already account for them
    # Instances the previous attempt could not reach: reported with this placement (scheduler.proto).
    unreachable: tuple[str, ...] = ()


class AttemptFailed(Exception):
    """A failure that another placement may get past; ``stage`` says where it happened."""

    def __init__(self, stage: str, message: str, *, before_first_token: bool, unreachable: str = "") -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.before_first_token = before_first_token
        self.unreachable = unreachable  # the instance id that could not be reached ("": none known)


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
                       released: bool = False, output_tokens: int = 0) -> asyncio.Future[None]:
        """Send the report in the background; the future is done once the scheduler has it (or
        the call failed). ``output_tokens`` > 0: the request finished at decode after generating
        that many."""
        ...

    def abort_in_decode(self, address: str, attempt_id: RequestId, reason: str, *,
                        index: int | None = None) -> None:
        """``index``: end only that choice; None: the whole request."""
        ...

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


def _failure(exc: grpc.aio.AioRpcError, stage: str, *, before_first_token: bool, unreachable: str = "") -> Exception:
    code = exc.code()
    details = exc.details() or (code.name if code is not None else "unknown error")
    role = stage.split(" ", 1)[0]  # the client hears "prefill", not the instance's address
    if code in _CLIENT_FAULT:
        log.info("%s refused the request: %s", stage, details)
        return InvalidRequestError(f"{role} refused the request: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeoutError(f"the request did not finish before its deadline ({role})")
    name = code.name if code is not None else "unknown"
    return AttemptFailed(stage, f"{name}: {details}", before_first_token=before_first_token,
                         unreachable=unreachable if code == grpc.StatusCode.UNAVAILABLE else "")


async def reconnected(channel: grpc.aio.Channel, timeout_s: float = RECONNECT_WAIT_S) -> None:
    """Return once ``channel`` is not failing calls at once any more, or after ``timeout_s``. A
    channel that lost its instance fails calls without trying until its next reconnect attempt,
    even when a restarted instance already listens on the address (the fault suite saw a health
    probe placed on a restarted decode fail this way 0.5 s after the decode registered)."""
    if channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        return
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except TimeoutError:
        pass  # still down: the call fails as UNAVAILABLE and the request is placed again


def _unreachable(exc: grpc.aio.AioRpcError, placement: scheduler_pb2.Placement, at_decode: bool) -> str:
    """The instance an UNAVAILABLE came from: decode when its stream broke or prefill's handoff
    to it failed, prefill otherwise."""
    if at_decode or (exc.details() or "").startswith(HANDOFF_FAILED):
        return placement.decode.instance_id
    return placement.prefill.instance_id


class Attempt:
    """One placement serving a request's ``n`` choices (``sampling.n``; 0 or 1: one).

    ``events`` yields (choice index, event) pairs: the n first tokens in index order, then
    decode's events as they come (``TokenEvent.index``); it ends once every choice finished. A
    choice whose reader stopped early is ``drop``ped: decode ends it alone, the others go on.
    """

    def __init__(self, calls: AttemptCalls, request: AttemptRequest, deadline: float,
                 clock: Callable[[], float]) -> None:
        self.request = request
        self.n = max(request.sampling.n, 1)
        self._calls = calls
        self._deadline = deadline
        self._clock = clock
        self._finished: set[int] = set()   # ended by the engines
        self._dropped: set[int] = set()    # ended by their reader
        self._decode_address: str | None = None  # known once decode holds the request
        self._over = False                 # the attempt ended: its own cleanup covered every choice
        self._generated: dict[int, int] = {}  # tokens each choice generated

    def _running(self) -> bool:
        return len(self._finished | self._dropped) < self.n

    def drop(self, index: int) -> None:
        """Choice ``index``'s reader stopped while others read on: end it in decode, now or once
        decode holds the request. No awaits (it may run in a cancelled task)."""
        if self._over or index in self._finished or index in self._dropped:
            return
        self._dropped.add(index)
        if self._decode_address is not None:
            self._calls.abort_in_decode(self._decode_address, self.request.attempt_id, "cancelled", index=index)

    async def events(self) -> AsyncGenerator[tuple[int, BackendEvent], None]:
        """Place and serve the request once; see the module docstring for how it ends."""
        calls, request, clock, n = self._calls, self.request, self._clock, self.n
        started = clock()
        placement = await calls.place(request, self._deadline)
        decode_address = placement.decode.address
        prefill_call: grpc.aio.UnaryStreamCall | None = None
        stream_call = None
        first_tokens = 0
        handed_off = done = False
        stage = f"prefill at {placement.prefill.address}"
        why = "failed"
        try:
            prefill_channel = calls.channel(placement.prefill.address)
            await reconnected(prefill_channel)
            prefill_call = prefill_pb2_grpc.PrefillStub(prefill_channel).Prefill(
                _prefill_request(request, placement), timeout=max(self._deadline - clock(), 0.001)
            )
            for index in range(n):
                first = await prefill_call.read()
                if first is grpc.aio.EOF or first.WhichOneof("event") != "first_token":
                    missing = "a first token" if n == 1 else f"choice {index}'s first token"
                    raise AttemptFailed(stage, f"ended without {missing}", before_first_token=index == 0)
                token = first.first_token
                if token.index != index:
                    raise InternalError(f"prefill sent choice {token.index}'s first token where {index}'s belongs")
                first_tokens += 1
                self._generated[index] = 1
                if token.finished:
                    self._finished.add(index)
                if index == n - 1:
                    done = len(self._finished) == n  # then prefill hands nothing off
                    report = calls.report_outcome(request, ttft_s=clock() - started,
                                                  cached_tokens=token.cached_tokens, released=done)
                    if done:
                        await _delivered(report)
                yield index, FirstToken(
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
            decode_address = self._decode_address = handed.handed_off.decode_address or decode_address
            for index in sorted(self._dropped - self._finished):  # readers that stopped before decode had it
                calls.abort_in_decode(decode_address, request.attempt_id, "cancelled", index=index)
            stage = f"decode at {decode_address}"
            decode_channel = calls.channel(decode_address)
            await reconnected(decode_channel)  # prefill just handed off: decode is up, maybe restarted
            stream_call = decode_pb2_grpc.DecodeStub(decode_channel).StreamTokens(
                decode_pb2.StreamRequest(request_id=request.attempt_id), timeout=max(self._deadline - clock(), 0.001)
            )
            async for event in stream_call:
                index = event.index
                if index in self._dropped:
                    continue  # sent before decode had the Abort
                if not 0 <= index < n or index in self._finished:
                    raise InternalError(f"decode sent tokens for choice {index}, which is not running")
                self._generated[index] = self._generated.get(index, 0) + len(event.token_ids)
                if event.finished:
                    self._finished.add(index)
                done = not self._running()
                if done:
                    await _delivered(calls.report_outcome(request, output_tokens=max(self._generated.values())))
                yield index, MoreTokens(
                    token_ids=tuple(event.token_ids),
                    finish_reason=finish_reason(event.finish_reason) if event.finished else None,
                    logprobs=tuple(token_logprob(lp) for lp in event.logprobs),
                )
                if done:
                    return
            if not self._running():  # the last running choices were dropped: decode ended them
                done = True
                return
            raise AttemptFailed(stage, "ended the stream before every choice finished", before_first_token=False)
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc, stage, before_first_token=first_tokens == 0,
                           unreachable=_unreachable(exc, placement, stream_call is not None)) from exc
        except (asyncio.CancelledError, GeneratorExit):
            why = "cancelled"  # the client went away, or a stop string ended it
            raise
        finally:
            # No awaits here: this runs inside a cancelled task when the client went away.
            self._over = True
            if prefill_call is None:
                pass  # cancelled before it was called
            elif done and stream_call is None:
                calls.let_prefill_finish(prefill_call)  # ended at its first tokens: prefill still stores the prompt
            else:
                prefill_call.cancel()
            if stream_call is not None:
                stream_call.cancel()
            if not done:
                calls.abort_in_decode(decode_address, request.attempt_id, why)
                if not handed_off:
                    calls.report_outcome(request, released=True)


async def _delivered(report: asyncio.Future[None]) -> None:
    """Wait up to ``FINISH_REPORT_WAIT_S`` for a finish report to reach the scheduler; the report
    itself is never cancelled here."""
    await asyncio.wait((report,), timeout=FINISH_REPORT_WAIT_S)


async def run_attempt(calls: AttemptCalls, request: AttemptRequest, deadline: float,
                      clock: Callable[[], float]) -> AsyncGenerator[BackendEvent, None]:
    """Place and serve ``request`` (one choice) once; see the module docstring for how it ends."""
    assert request.sampling.n <= 1, "n > 1 is served by choice_group"
    async with aclosing(Attempt(calls, request, deadline, clock).events()) as events:
        async for _, event in events:
            yield event
