"""The Prefill gRPC servicer: checks and converts messages around ``pipeline.py``.

The prompt's path — attach cached prefix blocks (local, a peer's, the kvstore's), compute the
rest (its chunks share forwards with other queued prompts': ``PrefillBatcher``), sample every
choice's first token and stream it to the gateway at once, export the new full blocks to the
kvstore in the background, hand the request and its KV to the chosen decode instance (by default
the last two a layer at a time while the prompt computes: ``layerwise.py``,
``layerwise_store.py``) — is ``PrefillPipeline``, testable without a network. With
``sampling.n > 1`` the prompt is computed once and each choice's first token is sampled from the
same logits (choice i with ``choice_seed(seed, i)``); one handoff carries them all, and decode
forks the prompt's KV.

A handoff that fails (decode gone or draining) ends the Prefill call with UNAVAILABLE after the
first token, so the gateway places the request again and continues the stream; the pages go
back either way. A draining instance refuses new calls with UNAVAILABLE "draining".
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from crescent.protos import decode_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.common.grpc_service import ChannelPool
from crescent.services.common.logs import request_id_var
from crescent.services.common.metrics import engine_metrics
from crescent.services.common.tls import PeerTls
from crescent.services.contract.choices import MAX_CHOICES
from crescent.services.engine.constraints import ConstraintError, Constraints
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.engine.engine import Engine
from crescent.services.engine.kv_cache import CacheFullError
from crescent.services.engine.logprobs import MAX_TOP_LOGPROBS
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import logprob_message
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.grpc_codecs import add_with_codecs
from crescent.services.kvwire.handoff_wire import encode_part
from crescent.services.prefill.batcher import PrefillBatcher
from crescent.services.prefill.handoff_mover import HandoffMovers
from crescent.services.prefill.layerwise import hands_off_layerwise
from crescent.services.prefill.layerwise_store import stores_layerwise
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.pipeline import (FirstToken, HandedOff, HandoffFailed, PrefillPipeline,
                                                PromptRun)
from crescent.services.prefill.prefix_pull import PeerDirectory, PrefixPuller, serve_prefix

log = logging.getLogger(__name__)

HANDOFF_METHOD = "/crescent.v1.Decode/Handoff"

# How a failed handoff ends the Prefill call; anything else is UNAVAILABLE: place it again.
_HANDOFF_FAILURES = {
    grpc.StatusCode.ABORTED: grpc.StatusCode.ABORTED,                        # the gateway aborted it
    grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # larger than that decode's cache
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INTERNAL,              # prefill and decode disagree
    grpc.StatusCode.ALREADY_EXISTS: grpc.StatusCode.INTERNAL,
}


def add_prefill_to_server(servicer: PrefillServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with FetchPrefix's replies encoded by ``chunk_wire``."""
    add_with_codecs(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer, server,
                    replies={"FetchPrefix": chunk_wire.encode_chunk})


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: Engine, worker: EngineWorker, kvstore: KvStoreClient | None, lease_ms: int,
                 on_blocks_stored, scheduler_address: str = "", constraints: Constraints | None = None,
                 tls: PeerTls | None = None, max_batch_tokens: int = 0, layerwise_handoff: bool = False,
                 layerwise_kvstore: bool = False, handoff_movers: HandoffMovers | None = None) -> None:
        """``max_batch_tokens``: prompt tokens per forward shared by queued prompts (``PrefillBatcher``);
        0: one prompt per forward. ``layerwise_handoff``: send the KV to decode a layer at a time
        while the prompt computes (``layerwise.py``), where the model's cache allows it;
        ``layerwise_kvstore``: write new blocks to the kvstore that way too (``layerwise_store.py``),
        where the node is on this host. ``handoff_movers``: a layer-wise handoff to a decode on this
        host goes through shared memory (``handoff_mover.py``; None: always gRPC bytes)."""
        self.engine = engine
        self.constraints = constraints
        self.worker = worker
        self.kvstore = kvstore
        self.lease_ms = lease_ms
        self.layerwise_handoff = layerwise_handoff and hands_off_layerwise(engine)
        self.layerwise_kvstore = layerwise_kvstore and stores_layerwise(engine) and kvstore is not None
        self._on_blocks_stored = on_blocks_stored
        self.handoff_movers = handoff_movers
        self._decode_channels = ChannelPool(tls)
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = engine_metrics("prefill")
        self.running = 0  # Prefill calls open
        self.draining = False
        self.load = PrefillLoad()
        self.batcher = PrefillBatcher(engine, worker, max_batch_tokens, self.metrics)
        self.puller = (PrefixPuller(engine, worker, self.metrics, PeerDirectory(scheduler_address, tls), tls)
                       if scheduler_address else None)
        self.pipeline = PrefillPipeline(**self._pipeline_args())

    def busy(self) -> bool:
        """Prefill calls open, or new blocks still on their way to the kvstore."""
        return self.running > 0 or bool(self._background)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._decode_channels.close()
        if self.puller is not None:
            await self.puller.close()
        await self.batcher.close()

    def handoff(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        """Decode's Handoff at ``address``, its parts encoded by ``handoff_wire`` (payloads joined
        once into the message, no protobuf copies): the pipeline's ``HandoffSink``."""
        return self._decode_channels.get(address).stream_unary(
            HANDOFF_METHOD, request_serializer=encode_part,
            response_deserializer=decode_pb2.HandoffReply.FromString,
        )

    def open_handoff(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """Decode's OpenHandoff at ``address`` (room on its handoff side channel), on the
        Handoff's channel."""
        return self._decode_channels.get(address).unary_unary(
            "/crescent.v1.Decode/OpenHandoff",
            request_serializer=decode_pb2.OpenHandoffRequest.SerializeToString,
            response_deserializer=decode_pb2.OpenHandoffReply.FromString)

    def _pipeline_args(self) -> dict:
        """What ``PrefillPipeline`` (or an aggregated instance's) is built from."""
        return dict(engine=self.engine, worker=self.worker, batcher=self.batcher, metrics=self.metrics,
                    load=self.load, sink=self, spawn=self._spawn, kvstore=self.kvstore,
                    lease_ms=self.lease_ms,
                    on_blocks_stored=self._on_blocks_stored, constraints=self.constraints, puller=self.puller,
                    layerwise_handoff=self.layerwise_handoff, layerwise_kvstore=self.layerwise_kvstore,
                    handoff_movers=self.handoff_movers,
                    # a pool on a GPU: the kvstore's blocks device to device (None on the CPU)
                    device_blocks=DeviceBlocks.for_cache(self.engine.cache) if self.kvstore is not None else None)

    def _refusal(self, request: prefill_pb2.PrefillRequest) -> tuple[grpc.StatusCode, str] | None:
        """Why ``request`` is refused before it takes anything (None: it is not)."""
        cfg, sampling, n = self.engine.config, request.sampling, max(request.sampling.n, 1)
        tokens = request.token_ids
        if self.draining:
            return grpc.StatusCode.UNAVAILABLE, "draining: this prefill instance takes no new requests"
        if request.model_id and request.model_id != self.engine.model_id:
            return (grpc.StatusCode.NOT_FOUND,
                    f"this instance serves {self.engine.model_id!r}, not {request.model_id!r}")
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not tokens:
            return bad, "token_ids is empty"
        if len(tokens) >= cfg.max_position_embeddings:
            return bad, (f"{len(tokens)} tokens leave no room in the "
                         f"{cfg.max_position_embeddings}-token context")
        if not request.decode_address and sampling.max_tokens != 1:
            return bad, "decode_address is required"
        if any(t < 0 or t >= cfg.vocab_size for t in tokens):
            return bad, f"token ids must be in [0, {cfg.vocab_size})"
        if sampling.logprobs and not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
            return bad, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"
        if n > MAX_CHOICES:
            return bad, f"n must be in [1, {MAX_CHOICES}]"
        if n > 1 and sampling.first_step > 0:  # a migrated choice continues alone
            return bad, "n > 1 is for new requests (first_step 0)"
        return None

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        refusal = self._refusal(request)
        if refusal is not None:
            await context.abort(*refusal)
        self.metrics.queue_depth.labels("prefill").set(self.worker.pending + 1)
        self.running += 1
        self.load.admit(request.request_id, len(request.token_ids))
        run: PromptRun | None = None
        try:
            await self._admit_prompt(request, context)
            run = self.pipeline.start(request)
            async for event in run.events():
                yield _event_message(event)
            self.metrics.requests.labels("prefill", "ok").inc()
        except ConstraintError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"constraint: {exc}")
        except HandoffFailed as exc:
            self.metrics.requests.labels("prefill", "error").inc()
            cause = exc.cause
            code = (_HANDOFF_FAILURES.get(cause.code(), grpc.StatusCode.UNAVAILABLE)
                    if isinstance(cause, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE)
            log.warning("%s", exc)
            await context.abort(code, str(exc))
        except CacheFullError as exc:
            self.metrics.requests.labels("prefill", "error").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except asyncio.CancelledError:
            self.metrics.requests.labels("prefill", "aborted").inc()
            raise
        finally:
            self._prompt_left(request.request_id)
            self.running -= 1
            self.load.left(request.request_id)
            self.metrics.queue_depth.labels("prefill").set(self.worker.pending)
            if run is not None:
                await run.close()  # the stream stopped and the pages let go

    # ---- what an aggregated instance changes (services/aggregated/servicer.py) -----------------

    async def _admit_prompt(self, request: prefill_pb2.PrefillRequest,
                            context: grpc.aio.ServicerContext) -> None:
        """Before the prompt takes pages: nothing here (a prefill instance's pages are its own)."""

    def _prompt_left(self, request_id: str) -> None:
        """The Prefill call ended (handed off or not)."""

    # ---- hot-prefix replication (see prefix_pull.py) -----------------------------------------

    async def FetchPrefix(self, request: prefill_pb2.FetchPrefixRequest, context: grpc.aio.ServicerContext):
        if request.model_id and request.model_id != self.engine.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"this instance serves {self.engine.model_id!r}, not {request.model_id!r}")
        needed = len(request.block_keys) * self.engine.block_size
        if len(request.token_ids) != needed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.block_keys)} block keys need {needed} token ids")
        async for chunk in serve_prefix(self.engine, self.worker, self.metrics, request):
            yield chunk

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)


def _event_message(event: FirstToken | HandedOff) -> prefill_pb2.PrefillEvent:
    if isinstance(event, HandedOff):
        return prefill_pb2.PrefillEvent(handed_off=prefill_pb2.HandedOff(decode_address=event.decode_address))
    return prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(
        token_id=event.token_id, prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens,
        finished=bool(event.finish_reason), finish_reason=event.finish_reason,
        logprob=logprob_message(event.logprob) if event.logprob is not None else None, index=event.index,
    ))


def _log_failure(task: asyncio.Task[None]) -> None:
    """A background task's exception is logged, not lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
