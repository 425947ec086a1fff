"""The Decode gRPC servicer: takes handed-off requests, streams their tokens, aborts on request.

Handoff accepts a request whenever it could ever fit this instance's cache; it then waits in
the batcher for its pages (see batcher.py) instead of being refused. Refusals: malformed input
(INVALID_ARGUMENT), a reservation larger than the whole cache (RESOURCE_EXHAUSTED), a request
aborted before it arrived (ABORTED), a draining instance (UNAVAILABLE).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc
from crescent.services.common.kv_block import BlockAssembler, BlockFormatError
from crescent.services.common.logs import request_id_var
from crescent.services.common.stop_rule import stop_token_ids
from crescent.services.decode.batcher import ABORTED, DRAINING, ERROR, Batcher, DecodeRequest
from crescent.services.engine.constraints import ConstraintError, Constraints, TokenConstraint, compile_constraint
from crescent.services.engine.wire import KV_DTYPE, block_tensor, logprob_message, sampling_config

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0  # an Abort that came before its Handoff refuses that Handoff this long

# How StreamTokens ends a request that did not finish normally.
_ENDINGS = {
    ERROR: grpc.StatusCode.INTERNAL,
    DRAINING: grpc.StatusCode.UNAVAILABLE,   # the gateway migrates it to another instance
    ABORTED: grpc.StatusCode.ABORTED,
}


def _max_tokens(header: decode_pb2.HandoffHeader) -> int:
    """Tokens to generate, prefill's first one included."""
    return max(header.sampling.max_tokens, 1)


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


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, batcher: Batcher, constraints: Constraints | None = None) -> None:
        self.batcher = batcher
        self.constraints = constraints
        self.engine = batcher.engine
        self.tombstones = Tombstones()

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this decode instance takes no new requests")
        start = time.perf_counter()
        header: decode_pb2.HandoffHeader | None = None
        assembler = BlockAssembler()
        payloads: list[torch.Tensor] = []
        received = 0
        try:
            async for part in request_iterator:
                if part.HasField("header"):
                    if header is not None:
                        raise BlockFormatError("a second handoff header")
                    header = part.header
                    request_id_var.set(header.request_id)
                    await self._refuse_early(header, context)  # before its KV crosses the wire
                    continue
                if header is None:
                    raise BlockFormatError("KV block before the handoff header")
                block = assembler.feed(part.block)
                if block is not None:
                    received += block.nbytes
                    payloads.append(block_tensor(block, block.shape))
        except BlockFormatError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed handoff: {exc}")
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty handoff")
        problem = self._check(header, payloads)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        token_ids = [*header.prompt_token_ids, header.first_token_id]
        first_step = max(header.sampling.first_step, 0)
        # The constraint continues where prefill left it: it takes every token generated so far.
        constraint = await self._constraint(header.sampling, token_ids[len(token_ids) - first_step - 1:], context)
        await self._refuse_early(header, context)  # again: the stream took a while
        stops = stop_token_ids(header.sampling.stop_token_ids, self.engine.config.eos_token_ids,
                               header.sampling.ignore_eos)
        self.batcher.accept(DecodeRequest(
            request_id=header.request_id, token_ids=token_ids,
            payloads=payloads, sampling=sampling_config(header.sampling, stops), max_tokens=_max_tokens(header),
            stop_token_ids=stops, reserve_tokens=self._reserve_tokens(header), first_step=first_step,
            constraint=constraint,
        ))
        metrics = self.batcher.metrics
        metrics.transfer_bytes.labels("decode", "handoff_in").inc(received)
        metrics.transfer_seconds.labels("decode", "handoff_in").observe(time.perf_counter() - start)
        return decode_pb2.HandoffReply(accepted=True)

    async def _constraint(self, sampling: common_pb2.SamplingParams, generated: list[int],
                          context: grpc.aio.ServicerContext) -> TokenConstraint | None:
        """The request's structured-output matcher (None: unconstrained); a bad one is INVALID_ARGUMENT."""
        try:
            return await compile_constraint(self.constraints, sampling, generated)
        except ConstraintError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"constraint: {exc}")
        raise AssertionError("abort raises")

    def _reserve_tokens(self, header: decode_pb2.HandoffHeader) -> int:
        """KV tokens the request may ever hold: prompt + max_tokens, within the context window."""
        return min(len(header.prompt_token_ids) + _max_tokens(header), self.engine.config.max_position_embeddings)

    async def _refuse_early(self, header: decode_pb2.HandoffHeader, context: grpc.aio.ServicerContext) -> None:
        """Refusals the header alone decides."""
        request_id = header.request_id
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this decode instance takes no new requests")
        if request_id in self.tombstones:
            await context.abort(grpc.StatusCode.ABORTED, f"request {request_id} was aborted")
        if self.batcher.holds(request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already here")
        reserve = self._reserve_tokens(header)
        if self.batcher.never_fits(reserve):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request needs {reserve} KV tokens (prompt {len(header.prompt_token_ids)} + max_tokens "
                f"{_max_tokens(header)}), more than this decode instance's whole cache of "
                f"{self.engine.cache.capacity_tokens} tokens",
            )

    def _check(self, header: decode_pb2.HandoffHeader, payloads: list[torch.Tensor]) -> str | None:
        cfg = self.engine.config
        if header.model_id != self.engine.model_id:
            return f"this instance serves {self.engine.model_id!r}, not {header.model_id!r}"
        prompt_len = len(header.prompt_token_ids)
        if prompt_len == 0 or prompt_len + 1 >= cfg.max_position_embeddings:
            return f"prompt of {prompt_len} tokens does not fit the context window"
        if header.kv_dtype != KV_DTYPE or tuple(header.kv_block_shape) != self.engine.cache.block_shape:
            return f"KV layout {header.kv_dtype} {tuple(header.kv_block_shape)} != {self.engine.cache.block_shape}"
        if len(payloads) != header.num_blocks or len(payloads) != -(-prompt_len // self.engine.page_size):
            return f"{len(payloads)} KV blocks for a prompt of {prompt_len} tokens"
        try:
            covered = sum(self.engine.cache.payload_tokens(p.shape) for p in payloads)
        except ValueError as exc:
            return str(exc)
        if covered != prompt_len:
            return "KV blocks do not cover the prompt exactly"
        return None

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        entry = self.batcher.requests.get(request.request_id)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id} on this instance")
        if entry.claimed:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} is already streaming")
        entry.claimed = True
        done = False
        try:
            while not done:
                update = await entry.queue.get()
                tokens = list(update.token_ids)
                logprobs = [logprob_message(lp) for lp in update.logprobs]
                while not entry.queue.empty() and update.finish_reason is None:  # catch up in one message
                    update = entry.queue.get_nowait()
                    tokens.extend(update.token_ids)
                    logprobs.extend(logprob_message(lp) for lp in update.logprobs)
                done = update.finish_reason is not None
                if update.finish_reason in _ENDINGS:
                    if tokens:  # never lose a token the client has not seen
                        yield decode_pb2.TokenEvent(token_ids=tokens, logprobs=logprobs)
                    message = "decode draining" if update.finish_reason == DRAINING else update.detail
                    await context.abort(_ENDINGS[update.finish_reason], message or update.finish_reason)
                yield decode_pb2.TokenEvent(token_ids=tokens, finished=done, finish_reason=update.finish_reason or "",
                                            logprobs=logprobs)
        finally:
            if done:
                self.batcher.forget(request.request_id)
            else:  # the reader went away (client disconnect): free the slot and KV now
                self.batcher.abort(request.request_id, "stream cancelled")

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> decode_pb2.AbortReply:
        request_id_var.set(request.request_id)
        found = self.batcher.abort(request.request_id, f"aborted by the caller: {request.reason or 'no reason given'}")
        if not found:
            self.tombstones.add(request.request_id)  # its handoff may still be on the way
        return decode_pb2.AbortReply(found=found)
