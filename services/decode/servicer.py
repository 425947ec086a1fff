"""The Decode gRPC servicer: converts messages around ``pipeline.py``.

Handoff accepts a request whenever it could ever fit this instance's cache; it then waits in
the batcher for its pages (see batcher.py) instead of being refused. Refusals: malformed input
(INVALID_ARGUMENT), a reservation larger than the whole cache (RESOURCE_EXHAUSTED), a request
aborted before it arrived (ABORTED), a draining instance (UNAVAILABLE), a layer-wise handoff
through a shared memory segment this process cannot (or may not) map (FAILED_PRECONDITION with
``handoff_shm.REFUSAL``: prefill sends it again with the bytes). What happens between a
request's arrival and its last token — landing (``handoff_in.py``), checks, admission, the
stream of updates and its end — is ``DecodePipeline``, testable without a network.

A handoff of ``n > 1`` choices carries every choice's first token; the choices decode on the
prompt's shared KV and stream through one StreamTokens call, each event tagged with its choice.
"""

from __future__ import annotations

from contextlib import aclosing

import grpc
import torch

from crescent.protos import decode_pb2, decode_pb2_grpc
from crescent.services.common.logs import request_id_var
from crescent.services.decode.batcher import Batcher
from crescent.services.decode.handoff_side import HandoffSideChannel
from crescent.services.decode.pipeline import DecodePipeline, Refusal, Refused
from crescent.services.decode.request import ABORTED, DRAINING, ERROR, DecodeRequest
from crescent.services.engine.constraints import Constraints
from crescent.services.engine.engine import Sequence
from crescent.services.instance.wire import logprob_message
from crescent.services.kvwire.grpc_codecs import add_with_codecs
from crescent.services.kvwire.handoff_wire import decode_part

# The status code of each refusal.
_REFUSALS = {
    Refusal.DRAINING: grpc.StatusCode.UNAVAILABLE,
    Refusal.ABORTED: grpc.StatusCode.ABORTED,
    Refusal.ALREADY_HERE: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.NEVER_FITS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.RESEND: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}

# How StreamTokens ends a request that did not finish normally.
_ENDINGS = {
    ERROR: grpc.StatusCode.INTERNAL,
    DRAINING: grpc.StatusCode.UNAVAILABLE,   # the gateway migrates it to another instance
    ABORTED: grpc.StatusCode.ABORTED,
}


def add_decode_to_server(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with Handoff's parts decoded by ``handoff_wire`` (the KV
    payloads are slices of the received messages, not protobuf's copies)."""
    add_with_codecs(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, server,
                    requests={"Handoff": decode_part})


async def _refuse(context: grpc.aio.ServicerContext, exc: Refused) -> None:
    await context.abort(_REFUSALS[exc.reason], str(exc))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, batcher: Batcher, constraints: Constraints | None = None, shm_handoff: bool = True,
                 side: HandoffSideChannel | None = None) -> None:
        """``shm_handoff``: map a layer-wise handoff's shared memory segment (off: refuse it);
        ``side``: the handoff side channel (TCP) OpenHandoff opens handoffs on (None: refuse)."""
        self.pipeline = DecodePipeline(batcher, constraints, shm_handoff, side)
        self.batcher = batcher
        self.engine = batcher.engine

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:
        try:
            await self.pipeline.handoff(request_iterator)
        except Refused as exc:
            await _refuse(context, exc)
        return decode_pb2.HandoffReply(accepted=True)

    async def accept(self, header: decode_pb2.HandoffHeader, payloads: list[torch.Tensor] | None,
                     context: grpc.aio.ServicerContext,
                     local_prompt: Sequence | None = None) -> DecodeRequest:
        """``DecodePipeline.accept``, its refusals aborting ``context`` (an aggregated instance's
        in-process handoff passes one that raises them)."""
        try:
            return await self.pipeline.accept(header, payloads, local_prompt)
        except Refused as exc:
            await _refuse(context, exc)
        raise AssertionError("abort raises")

    async def OpenHandoff(self, request: decode_pb2.OpenHandoffRequest,
                          context: grpc.aio.ServicerContext) -> decode_pb2.OpenHandoffReply:
        """Room for a layer-wise handoff's KV on the side channel (``handoff_side.py``)."""
        request_id_var.set(request.request_id)
        try:
            address, token = self.pipeline.open_handoff(request.request_id, request.total_bytes)
        except Refused as exc:
            await _refuse(context, exc)
        return decode_pb2.OpenHandoffReply(address=address, token=token)

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        try:
            updates = self.pipeline.stream(request.request_id)
        except Refused as exc:
            await _refuse(context, exc)
        async with aclosing(updates):  # closed here: a reader that went away aborts the request
            async for update in updates:
                if update.finish_reason in _ENDINGS:
                    message = "decode draining" if update.finish_reason == DRAINING else update.detail
                    await context.abort(_ENDINGS[update.finish_reason], message or update.finish_reason)
                yield decode_pb2.TokenEvent(
                    token_ids=update.token_ids, finished=update.finish_reason is not None,
                    finish_reason=update.finish_reason or "", index=update.index,
                    logprobs=[logprob_message(lp) for lp in update.logprobs])

    async def Abort(self, request: decode_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> decode_pb2.AbortReply:
        request_id_var.set(request.request_id)
        found = self.pipeline.abort(request.request_id, request.reason, request.one_choice, request.index)
        return decode_pb2.AbortReply(found=found)
