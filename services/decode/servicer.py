"""The Decode gRPC servicer: takes handed-off requests, streams their tokens, aborts on request.

Handoff accepts a request whenever it could ever fit this instance's cache; it then waits in
the batcher for its pages (see batcher.py) instead of being refused. Refusals: malformed input
(INVALID_ARGUMENT), a reservation larger than the whole cache (RESOURCE_EXHAUSTED), a request
aborted before it arrived (ABORTED), a draining instance (UNAVAILABLE), a layer-wise handoff
through a shared memory segment this process cannot (or may not) map (FAILED_PRECONDITION with
``handoff_shm.REFUSAL``: prefill sends it again with the bytes). How the KV lands — whole blocks,
layer-wise bytes, shared memory or the TCP side channel — is ``handoff_in.py``.

A handoff of ``n > 1`` choices carries every choice's first token; the choices decode on the
prompt's shared KV and stream through one StreamTokens call, each event tagged with its choice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc
from crescent.services.contract.choices import choice_seed, reserve_tokens
from crescent.services.kvwire.grpc_codecs import add_with_codecs
from crescent.services.kvwire.handoff_tcp import TCP_REFUSAL
from crescent.services.kvwire.handoff_wire import decode_part
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.common.logs import request_id_var
from crescent.services.contract.finish import stop_token_ids
from crescent.services.decode.batcher import Batcher
from crescent.services.decode.handoff_in import HandoffIntake, HandoffRefused, first_tokens, open_choices
from crescent.services.decode.handoff_side import HandoffSideChannel, HandoffTooLarge
from crescent.services.decode.request import ABORTED, DRAINING, ERROR, Choice, DecodeRequest, TokenUpdate
from crescent.services.engine.constraints import (ConstraintError, Constraints, TokenConstraint,
                                                  compile_constraint)
from crescent.services.engine.engine import Sequence
from crescent.services.instance.wire import logprob_message, sampling_config

log = logging.getLogger(__name__)

_DRAINING = "draining: this decode instance takes no new requests"
TOMBSTONE_TTL_S = 60.0  # an Abort that came before its Handoff refuses that Handoff this long

# How StreamTokens ends a request that did not finish normally.
_ENDINGS = {
    ERROR: grpc.StatusCode.INTERNAL,
    DRAINING: grpc.StatusCode.UNAVAILABLE,   # the gateway migrates it to another instance
    ABORTED: grpc.StatusCode.ABORTED,
}


def never_fits_message(prompt_tokens: int, max_tokens: int, reserve: int, choices: int, capacity: int,
                       where: str = "this decode instance") -> str:
    """Why a request whose reservation exceeds the whole cache is refused (RESOURCE_EXHAUSTED)."""
    each = f" for each of {choices} choices" if choices > 1 else ""
    return (f"request needs {reserve} KV tokens (prompt {prompt_tokens} + max_tokens {max_tokens}){each}, "
            f"more than {where}'s whole cache of {capacity} tokens")


def _max_tokens(header: decode_pb2.HandoffHeader) -> int:
    """Tokens to generate, prefill's first one included."""
    return max(header.sampling.max_tokens, 1)


def _coalesced(updates: list[TokenUpdate]) -> list[TokenUpdate]:
    """Consecutive updates of one choice in one message (a reader that fell behind catches up)."""
    out: list[TokenUpdate] = []
    for update in updates:
        prev = out[-1] if out else None
        if (prev is not None and prev.finish_reason is None and prev.index == update.index
                and update.finish_reason not in _ENDINGS):
            out[-1] = replace(update, token_ids=prev.token_ids + update.token_ids,
                              logprobs=prev.logprobs + update.logprobs)
        else:
            out.append(update)
    return out


class Tombstones:
    """Ids of requests aborted before they arrived, each remembered for ``ttl_s``."""

    def __init__(self, ttl_s: float = TOMBSTONE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._until: dict[str, float] = {}

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._until = {k: t for k, t in self._until.items() if t > now}  # forget the old ones
        self._until[request_id] = now + self.ttl_s

    def __contains__(self, request_id: str) -> bool:
        return self._until.get(request_id, 0.0) > time.monotonic()


def add_decode_to_server(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with Handoff's parts decoded by ``handoff_wire`` (the KV
    payloads are slices of the received messages, not protobuf's copies)."""
    add_with_codecs(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, server,
                    requests={"Handoff": decode_part})


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, batcher: Batcher, constraints: Constraints | None = None, shm_handoff: bool = True,
                 side: HandoffSideChannel | None = None) -> None:
        """``shm_handoff``: map a layer-wise handoff's shared memory segment (off: refuse it);
        ``side``: the handoff side channel (TCP) OpenHandoff opens handoffs on (None: refuse)."""
        self.batcher = batcher
        self.side = side
        self.constraints = constraints
        self.engine = batcher.engine
        self.intake = HandoffIntake(self.engine, shm_handoff, side)
        self.tombstones = Tombstones()

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
        start = time.perf_counter()

        async def on_header(header: decode_pb2.HandoffHeader) -> None:
            request_id_var.set(header.request_id)
            await self._refuse_early(header, context)

        try:  # the four landing modes: handoff_in.py
            landed = await self.intake.land(request_iterator, on_header)
        except BlockFormatError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed handoff: {exc}")
        except HandoffRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        header, payloads = landed.header, landed.payloads
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty handoff")
        problem = self.intake.problem(header, payloads)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        await self.accept(header, payloads, context)
        metrics = self.batcher.metrics
        metrics.transfer_bytes.labels("decode", "handoff_in").inc(landed.received)
        metrics.transfer_seconds.labels("decode", "handoff_in").observe(time.perf_counter() - start)
        return decode_pb2.HandoffReply(accepted=True)

    async def accept(self, header: decode_pb2.HandoffHeader, payloads: list[torch.Tensor] | None,
                     context: grpc.aio.ServicerContext,
                     local_prompt: Sequence | None = None) -> DecodeRequest:
        """Hand a checked request to the batcher: its KV in ``payloads`` (a handoff), or in
        ``local_prompt``, a sequence this process prefilled (an aggregated instance)."""
        first_step = max(header.sampling.first_step, 0)
        stops = stop_token_ids(header.sampling.stop_token_ids, self.engine.config.eos_token_ids,
                               header.sampling.ignore_eos)
        sampling = sampling_config(header.sampling, stops)
        choices = []
        for index, first in enumerate(first_tokens(header)):
            if index in header.finished_choices:
                continue
            token_ids = [*header.prompt_token_ids, first]
            # The constraint continues where prefill left it: it takes every token generated so far.
            generated = token_ids[len(token_ids) - first_step - 1:]
            constraint = await self._constraint(header.sampling, generated, context)
            choices.append(Choice(index, token_ids, replace(sampling, seed=choice_seed(sampling.seed, index)),
                                  constraint))
        if local_prompt is None:
            await self._refuse_early(header, context)  # again: the stream took a while
        # A local prompt was accepted here before any drain began: it is finished, not refused.
        elif header.request_id in self.tombstones:  # the gateway aborted it while it was prefilled here
            await context.abort(grpc.StatusCode.ABORTED, f"request {header.request_id} was aborted")
        request = DecodeRequest(
            request_id=header.request_id, choices=choices, payloads=payloads, max_tokens=_max_tokens(header),
            stop_token_ids=stops, reserve_tokens=self._reserve_tokens(header), first_step=first_step,
            local_prompt=local_prompt,
        )
        self.batcher.accept(request)
        return request

    async def _constraint(self, sampling: common_pb2.SamplingParams, generated: list[int],
                          context: grpc.aio.ServicerContext) -> TokenConstraint | None:
        """The request's structured-output matcher (None: unconstrained); a bad one is INVALID_ARGUMENT."""
        try:
            return await compile_constraint(self.constraints, sampling, generated)
        except ConstraintError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"constraint: {exc}")
        raise AssertionError("abort raises")

    def _reserve_tokens(self, header: decode_pb2.HandoffHeader) -> int:
        return reserve_tokens(len(header.prompt_token_ids), _max_tokens(header),
                              self.engine.config.max_position_embeddings)

    async def _refuse_early(self, header: decode_pb2.HandoffHeader,
                            context: grpc.aio.ServicerContext) -> None:
        """Refusals the header alone decides."""
        request_id = header.request_id
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
        if request_id in self.tombstones:
            await context.abort(grpc.StatusCode.ABORTED, f"request {request_id} was aborted")
        if self.batcher.holds(request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already here")
        reserve = self._reserve_tokens(header)
        choices = open_choices(header)
        if self.batcher.never_fits(len(header.prompt_token_ids), reserve, choices):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, never_fits_message(
                len(header.prompt_token_ids), _max_tokens(header), reserve, choices,
                self.engine.cache.capacity_tokens))

    async def OpenHandoff(self, request: decode_pb2.OpenHandoffRequest,
                          context: grpc.aio.ServicerContext) -> decode_pb2.OpenHandoffReply:
        """Room for a layer-wise handoff's KV on the side channel (``handoff_side.py``)."""
        request_id_var.set(request.request_id)
        if self.side is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{TCP_REFUSAL} no side channel on this decode instance")
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            token = self.side.open(request.request_id, request.total_bytes)
        except HandoffTooLarge as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return decode_pb2.OpenHandoffReply(address=self.side.address, token=token)

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        entry = self.batcher.requests.get(request.request_id)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id} on this instance")
        if entry.claimed:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request.request_id} is already streaming")
        entry.claimed = True
        done = False
        try:
            while not done:
                updates = [await entry.queue.get()]
                while not entry.queue.empty():
                    updates.append(entry.queue.get_nowait())
                for update in _coalesced(updates):  # tokens before an ending go out first: none is lost
                    if update.finish_reason in _ENDINGS:
                        done = True
                        message = "decode draining" if update.finish_reason == DRAINING else update.detail
                        await context.abort(_ENDINGS[update.finish_reason], message or update.finish_reason)
                    yield decode_pb2.TokenEvent(
                        token_ids=update.token_ids, finished=update.finish_reason is not None,
                        finish_reason=update.finish_reason or "", index=update.index,
                        logprobs=[logprob_message(lp) for lp in update.logprobs])
                    if update.last:
                        done = True
                        break
        finally:
            if done:
                self.batcher.forget(request.request_id)
            else:  # the reader went away (client disconnect): free the slot and KV now
                self.batcher.abort(request.request_id, "stream cancelled")

    async def Abort(self, request: decode_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.AbortReply:
        request_id_var.set(request.request_id)
        why = f"aborted by the caller: {request.reason or 'no reason given'}"
        if request.one_choice:
            found = self.batcher.abort_choice(request.request_id, request.index, why)
        else:
            found = self.batcher.abort(request.request_id, why)
        if not found and not request.one_choice:
            self.tombstones.add(request.request_id)  # its handoff may still be on the way
        return decode_pb2.AbortReply(found=found)
