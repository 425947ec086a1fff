"""The Decode gRPC servicer: takes handed-off requests and streams their tokens."""

from __future__ import annotations

import logging
import time

import grpc
import torch

from crescent.protos import decode_pb2, decode_pb2_grpc
from crescent.services.common.kv_block import BlockAssembler, BlockFormatError
from crescent.services.common.logs import request_id_var
from crescent.services.decode.batcher import Batcher, DecodeRequest
from crescent.services.engine.kv_cache import CacheFullError
from crescent.services.engine.wire import KV_DTYPE, block_tensor, sampling_config

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.engine = batcher.engine

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:
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
        if header.request_id in self.batcher.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {header.request_id} is already here")
        prompt = list(header.prompt_token_ids)
        try:
            seq = await self.batcher.worker.run(
                self.engine.adopt_sequence, header.request_id, prompt + [header.first_token_id], len(prompt), payloads,
                orphan=self.engine.release,  # prefill gave up mid-call: give the pages back
            )
        except CacheFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        stop = set(header.sampling.stop_token_ids)
        if not header.sampling.ignore_eos:
            stop.update(self.engine.config.eos_token_ids)
        self.batcher.admit(DecodeRequest(
            request_id=header.request_id, seq=seq, sampling=sampling_config(header.sampling),
            max_tokens=max(header.sampling.max_tokens, 1), stop_token_ids=frozenset(stop),
        ))
        metrics = self.batcher.metrics
        metrics.transfer_bytes.labels("decode", "handoff_in").inc(received)
        metrics.transfer_seconds.labels("decode", "handoff_in").observe(time.perf_counter() - start)
        return decode_pb2.HandoffReply(accepted=True)

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
                while not entry.queue.empty() and update.finish_reason is None:  # catch up in one message
                    update = entry.queue.get_nowait()
                    tokens.extend(update.token_ids)
                done = update.finish_reason is not None
                if update.finish_reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, "decode step failed")
                yield decode_pb2.TokenEvent(token_ids=tokens, finished=done, finish_reason=update.finish_reason or "")
        finally:
            if done:
                self.batcher.forget(request.request_id)
            else:  # the reader went away (client disconnect): free the slot and KV now
                await self.batcher.abort(request.request_id, "stream cancelled")
