"""The Prefill gRPC servicer: cached prefix in, first token and a handed-off request out.

For each request: attach the longest locally cached prefix, fetch the following prefix blocks
from the kvstore, compute the rest (its chunks share forwards with other queued prompts':
``PrefillBatcher``), sample the first token and stream it to the gateway at once;
then push the request and all its KV to the chosen decode instance, and write the prompt's new
full blocks to the kvstore in the background (by default both a layer at a time while the prompt
computes: ``layerwise.py``, ``layerwise_store.py``). With ``sampling.n > 1`` the prompt is computed
once and each choice's first token is sampled from the same logits (choice i with
``choice_seed(seed, i)``); one handoff carries them all, and decode forks the prompt's KV.

A handoff that fails (decode gone or draining) ends the Prefill call with UNAVAILABLE after the
first token, so the gateway places the request again and continues the stream; the pages go
back either way. A draining instance refuses new calls with UNAVAILABLE "draining".
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.contract.choices import MAX_CHOICES, choice_seed
from crescent.services.common.grpc_service import ChannelPool
from crescent.services.common.tls import PeerTls
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.grpc_codecs import add_with_codecs
from crescent.services.kvwire.handoff_wire import encode_part, handoff_parts
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.common.logs import request_id_var
from crescent.services.common.metrics import engine_metrics
from crescent.services.contract.finish import finish_reason, stop_token_ids
from crescent.services.engine.constraints import (
    ConstraintError,
    Constraints,
    TokenConstraint,
    compile_constraint,
    submit_masks,
)
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.engine.kv_cache import CacheFullError
from crescent.services.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, batch_logprobs
from crescent.services.instance.runtime import EngineWorker
from crescent.services.engine.sampler import sample_batch
from crescent.services.instance.wire import (
    block_matches,
    block_tensor,
    kv_dtype,
    logprob_message,
    sampling_config,
)
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.prefill.batcher import PrefillBatcher
from crescent.services.kvwire.movers import GRPC
from crescent.services.prefill.handoff_mover import HandoffMovers
from crescent.services.prefill.layerwise import LayerwiseHandoff, hands_off_layerwise
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport, stores_layerwise
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.prompt_export import PromptExport
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


class _PageHold:
    """A sequence's pages go back once every holder (the call, the kvstore export) lets go."""

    def __init__(self, worker: EngineWorker, release, seq: Sequence, after_release) -> None:
        self._worker, self._release, self._seq, self._after = worker, release, seq, after_release
        self._holders = 1

    def acquire(self) -> None:
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._worker.submit(self._release, self._seq)
            self._after()


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

    async def _constraint(self, sampling: common_pb2.SamplingParams, generated: list[int],
                          context: grpc.aio.ServicerContext) -> TokenConstraint | None:
        """The request's structured-output matcher (None: unconstrained); a bad one is INVALID_ARGUMENT."""
        try:
            return await compile_constraint(self.constraints, sampling, generated)
        except ConstraintError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"constraint: {exc}")
        raise AssertionError("abort raises")

    def _handoff_call(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        """Decode's Handoff at ``address``, its parts encoded by ``handoff_wire`` (payloads joined
        once into the message, no protobuf copies)."""
        return self._decode_channels.get(address).stream_unary(
            HANDOFF_METHOD, request_serializer=encode_part, response_deserializer=decode_pb2.HandoffReply.FromString,
        )

    def _open_handoff_call(self, address: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """Decode's OpenHandoff at ``address`` (room on its handoff side channel), on the Handoff's channel."""
        return self._decode_channels.get(address).unary_unary(
            "/crescent.v1.Decode/OpenHandoff", request_serializer=decode_pb2.OpenHandoffRequest.SerializeToString,
            response_deserializer=decode_pb2.OpenHandoffReply.FromString)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this prefill instance takes no new requests")
        cfg = self.engine.config
        if request.model_id and request.model_id != self.engine.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this instance serves {self.engine.model_id!r}, not {request.model_id!r}")
        tokens = list(request.token_ids)
        if not tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if len(tokens) >= cfg.max_position_embeddings:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(tokens)} tokens leave no room in the {cfg.max_position_embeddings}-token context")
        if not request.decode_address and request.sampling.max_tokens != 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is required")
        if any(t < 0 or t >= cfg.vocab_size for t in tokens):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {cfg.vocab_size})")
        if request.sampling.logprobs and not 0 <= request.sampling.top_logprobs <= MAX_TOP_LOGPROBS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        n = max(request.sampling.n, 1)
        if n > MAX_CHOICES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n must be in [1, {MAX_CHOICES}]")
        if n > 1 and request.sampling.first_step > 0:  # a migrated choice continues alone
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n > 1 is for new requests (first_step 0)")

        self.metrics.queue_depth.labels("prefill").set(self.worker.pending + 1)
        self.running += 1
        self.load.admit(request.request_id, len(tokens))
        seq: Sequence | None = None
        hold: _PageHold | None = None
        streamed: LayerwiseHandoff | None = None
        layered: LayerwiseStoreExport | None = None  # stopped in the end unless the store export took it
        try:
            await self._admit_prompt(request, context)
            # A moved request's streamed tokens are computed as decode computed them (bit for bit).
            seq = await self.worker.run(self.engine.add_sequence, request.request_id, tokens, salt=request.cache_salt,
                                        decode_tail=max(request.sampling.first_step, 0), orphan=self.engine.release)
            hold = _PageHold(self.worker, self.engine.release, seq, self._on_blocks_stored)
            local_hit = seq.num_cached
            peer_hit = await self._pull_from_peer(request, seq)
            remote_hit = await self._attach_from_kvstore(seq)
            self.load.cached(request.request_id, seq.num_cached)
            stop_ids = stop_token_ids(request.sampling.stop_token_ids, cfg.eos_token_ids, request.sampling.ignore_eos)
            step = max(request.sampling.first_step, 0)  # after a migration: the client has that many tokens
            constraint = await self._constraint(request.sampling, tokens[len(tokens) - step:], context)
            start = time.perf_counter()
            sampling = sampling_config(request.sampling, stop_ids)
            # n > 1: every choice's first token from the same logits, each with its own seed.
            cfgs = [replace(sampling, seed=choice_seed(sampling.seed, i)) for i in range(n)]
            self.load.computing(request.request_id)
            mask = submit_masks([constraint]) if constraint is not None else None  # computed while the forward runs
            export = PromptExport(self.engine, self.worker, seq, len(tokens))  # one copy for kvstore and handoff
            if self.layerwise_handoff and request.decode_address and request.sampling.max_tokens != 1:
                streamed = LayerwiseHandoff(self.engine, seq, export, self._handoff_header(request, [0], []),
                                            self.handoff_movers, request.decode_address)
                streamed.start(self._handoff_call(request.decode_address), self._open_handoff_call(request.decode_address))

            layered = self._layered_export(seq, local_hit + peer_hit + remote_hit, streamed)
            hooks = [h.on_layer for h in (streamed, layered) if h is not None]
            logits = await self._prompt_logits(seq, _fan_out(hooks) if hooks else None)
            computed_at = time.perf_counter()

            def sample_firsts() -> tuple[list[int], list[TokenLogprob | None]]:
                rows = logits[None].repeat(n, 1)
                firsts = sample_batch(rows, cfgs, [step] * n, [tokens] * n, mask.result() * n if mask else None)
                return firsts, batch_logprobs(rows, firsts, [c.logprobs for c in cfgs])

            firsts, logprobs = await self.worker.run(sample_firsts)
            self.load.done(request.request_id)
            self.metrics.step_seconds.labels("prefill").observe(time.perf_counter() - start)
            self._count(len(tokens), local_hit, remote_hit, peer_hit)

            reasons = [finish_reason(first, 1, request.sampling.max_tokens, stop_ids) for first in firsts]
            finished = [i for i, reason in enumerate(reasons) if reason is not None]
            if self.kvstore is not None:
                # Not tied to this call: the blocks are worth keeping even if the client has gone.
                hold.acquire()
                self._spawn(self._store_new_blocks(seq, local_hit + peer_hit + remote_hit, hold, export,
                                                   layered, computed_at))
                layered = None
            for i, (first, logprob) in enumerate(zip(firsts, logprobs)):
                yield prefill_pb2.PrefillEvent(
                    first_token=prefill_pb2.FirstToken(
                        token_id=first, prompt_tokens=len(tokens), cached_tokens=seq.num_cached,
                        finished=i in finished,
                        finish_reason=reasons[i] or "",
                        logprob=logprob_message(logprob) if logprob is not None else None, index=i,
                    )
                )
            if len(finished) < n:
                try:
                    if streamed is not None:
                        await self._finish_layerwise(streamed, firsts, finished)
                    else:
                        await self._hand_off(request, seq, firsts, finished, hold, export)
                except grpc.aio.AioRpcError as exc:
                    self.metrics.requests.labels("prefill", "error").inc()
                    code = _HANDOFF_FAILURES.get(exc.code(), grpc.StatusCode.UNAVAILABLE)
                    log.warning("handoff to decode %s failed: %s %s", request.decode_address, exc.code().name, exc.details())
                    await context.abort(code, f"handoff to decode {request.decode_address} failed: "
                                              f"{exc.code().name}: {exc.details()}")
                except TimeoutError:  # a layer-wise handoff's reply did not come (the other path's deadline)
                    self.metrics.requests.labels("prefill", "error").inc()
                    log.warning("handoff to decode %s: no reply", request.decode_address)
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"handoff to decode {request.decode_address} failed: no reply")
                yield prefill_pb2.PrefillEvent(handed_off=prefill_pb2.HandedOff(decode_address=request.decode_address))
            self.metrics.requests.labels("prefill", "ok").inc()
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
            if streamed is not None:
                await streamed.close()  # before the pages go back: the stream reads them
            if layered is not None:
                await layered.close()  # no copy out of the pages after this; its room goes back
            if hold is not None:
                hold.release()

    # ---- what an aggregated instance changes (services/aggregated/servicer.py) -----------------

    async def _admit_prompt(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        """Before the prompt takes pages: nothing here (a prefill instance's pages are its own)."""

    def _prompt_left(self, request_id: str) -> None:
        """The Prefill call ended (handed off or not)."""

    async def _prompt_logits(self, seq: Sequence, on_layer=None) -> torch.Tensor:  # noqa: ANN001
        """Compute the prompt (its chunks in forwards shared with other queued prompts'); its
        last token's logits (vocab,). ``on_layer``: a layer-wise handoff's hook."""
        return await self.batcher.prefill(seq, on_layer)

    def _count(self, prompt: int, local_hit: int, remote_hit: int, peer_hit: int = 0) -> None:
        m = self.metrics
        m.prompt_tokens.labels("prefill").inc(prompt)
        m.cached_tokens.labels("prefill", "local").inc(local_hit)
        m.cached_tokens.labels("prefill", "kvstore").inc(remote_hit)
        m.cached_tokens.labels("prefill", "peer").inc(peer_hit)
        m.computed_tokens.labels("prefill").inc(prompt - local_hit - remote_hit - peer_hit)

    # ---- hot-prefix replication (see prefix_pull.py) -----------------------------------------

    async def _pull_from_peer(self, request: prefill_pb2.PrefillRequest, seq: Sequence) -> int:
        """Prefix blocks the placement says a peer holds beyond our own: pull and keep them."""
        if self.puller is None or not request.prefix_source_id or request.prefix_source_blocks <= 0:
            return 0
        return await self.puller.pull(seq, request.prefix_source_id, request.prefix_source_blocks,
                                      address=request.prefix_source_address)

    async def FetchPrefix(self, request: prefill_pb2.FetchPrefixRequest, context: grpc.aio.ServicerContext):
        if request.model_id and request.model_id != self.engine.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this instance serves {self.engine.model_id!r}, not {request.model_id!r}")
        if len(request.token_ids) != len(request.block_keys) * self.engine.page_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.block_keys)} block keys need {len(request.block_keys) * self.engine.page_size} token ids")
        async for chunk in serve_prefix(self.engine, self.worker, self.metrics, request):
            yield chunk

    async def _attach_from_kvstore(self, seq: Sequence) -> int:
        if self.kvstore is None:
            return 0
        keys = self.engine.missing_prefix_keys(seq)
        if not keys:
            return 0
        start = time.perf_counter()
        blocks = await self.kvstore.get_prefix(keys, self.engine.model_id, lease_ms=self.lease_ms)
        first_block = seq.num_computed // self.engine.page_size
        usable = []
        for i, block in enumerate(blocks):
            expected = seq.token_ids[(first_block + i) * self.engine.page_size : (first_block + i + 1) * self.engine.page_size]
            if not block_matches(block, keys[i], expected, self.engine.cache):
                log.warning("kvstore block %s does not match the prompt; recomputing from there", block.key.hex())
                break
            usable.append(block_tensor(block, tuple(block.shape)))
        added = await self.worker.run(self.engine.attach_blocks, seq, usable) if usable else 0
        if added:
            nbytes = sum(b.nbytes for b in blocks[: len(usable)])
            self.metrics.transfer_bytes.labels("prefill", "from_kvstore").inc(nbytes)
            self.metrics.transfer_seconds.labels("prefill", "from_kvstore").observe(time.perf_counter() - start)
        return added

    def _layered_export(self, seq: Sequence, already_cached: int,
                        streamed: LayerwiseHandoff | None) -> LayerwiseStoreExport | None:
        """A layer-wise export of the prompt's new blocks, started (a chunk at a time where the
        node takes no layer-wise puts; kimi_k3: each block once final). With a layer-wise
        handoff ``streamed``, the export reads the layers it copied out of the cache."""
        if not self.layerwise_kvstore:
            return None
        assert self.kvstore is not None  # layerwise_kvstore is on only with a kvstore
        layered = LayerwiseStoreExport(self.engine, seq, already_cached, self.kvstore, source=streamed)
        if not layered.wanted:
            return None
        layered.start(self._spawn)
        return layered

    async def _export_new_blocks(self, seq: Sequence, already_cached: int, export: PromptExport,
                                 only: list[int] | None = None) -> list[KvBlock]:
        """The prompt's full blocks that came from neither cache (``only`` these, if given), for
        the kvstore (none for a prompt too short to be cached: ``Engine.min_cached_prompt_tokens``);
        their payloads are the ones the handoff sends."""
        if self.kvstore is None or not seq.keeps_blocks:
            return []
        page = self.engine.page_size
        indices = range(already_cached // page, len(seq.block_keys)) if only is None else only
        payloads = await export.payloads(indices)
        return [
            KvBlock.build(seq.block_keys[i], seq.block_keys[i - 1] if i else None, self.engine.model_id,
                          kv_dtype(self.engine.cache), export.shape(i), seq.token_ids[i * page : (i + 1) * page], payload)
            for i, payload in zip(indices, payloads)
        ]

    async def _store_new_blocks(self, seq: Sequence, already_cached: int, hold: _PageHold, export: PromptExport,
                                layered: LayerwiseStoreExport | None,
                                computed_at: float) -> None:
        """The new blocks into the kvstore: what a layer-wise export did not store, whole.
        Metrics: ``to_kvstore_exposed``, the seconds from the prompt computed to its new blocks
        stored; ``to_kvstore_hidden``, the bytes written before its last layer was computed."""
        try:
            left = await layered.finished() if layered is not None else None
            blocks = await self._export_new_blocks(seq, already_cached, export, left)
        finally:
            hold.release()
        self._count_copied(export)
        if layered is not None:
            m = self.metrics
            m.transfer_bytes.labels("prefill", "to_kvstore").inc(layered.bytes_written)
            m.transfer_bytes.labels("prefill", "to_kvstore_hidden").inc(layered.bytes_early)
            m.transfer_bytes.labels("prefill", "copied_out").inc(layered.bytes_from_cache)
        if blocks:
            await self._store_blocks(blocks)
        if blocks or (layered is not None and layered.bytes_written):
            self.metrics.transfer_seconds.labels("prefill", "to_kvstore_exposed").observe(time.perf_counter() - computed_at)

    async def _store_blocks(self, blocks: list[KvBlock]) -> None:
        assert self.kvstore is not None
        start = time.perf_counter()
        result = await self.kvstore.put(blocks)
        if result.rejected:
            log.warning("kvstore kept %d of %d new blocks", result.stored, len(blocks))
        self.metrics.transfer_bytes.labels("prefill", "to_kvstore").inc(sum(b.nbytes for b in blocks))
        self.metrics.transfer_seconds.labels("prefill", "to_kvstore").observe(time.perf_counter() - start)

    async def _hand_off(self, request: prefill_pb2.PrefillRequest, seq: Sequence, firsts: list[int],
                        finished: list[int], hold: _PageHold, export: PromptExport) -> None:
        """Push the request (every choice's first token) and the prompt's KV, once, to decode.
        (``hold`` keeps the prompt's pages; an in-process handoff holds them longer.) The
        payloads are ``export``'s: blocks the kvstore export copied already are not copied again."""
        start = time.perf_counter()
        payloads = await export.payloads(range(export.num_blocks))
        self._count_copied(export)
        blocks = [
            (common_pb2.BlockMeta(key=f"{request.request_id}/{i}".encode(), model_id=self.engine.model_id,
                                  dtype=kv_dtype(self.engine.cache), shape=list(export.shape(i)),
                                  nbytes=len(payload), found=True), payload)
            for i, payload in enumerate(payloads)
        ]
        parts = handoff_parts(self._handoff_header(request, firsts, finished), blocks)
        await self._handoff_call(request.decode_address)(parts, timeout=60)
        if self.handoff_movers is not None:
            self.handoff_movers.handed_off(request.decode_address, GRPC, sum(len(p) for p in payloads))
        self.metrics.transfer_bytes.labels("prefill", "handoff_out").inc(sum(len(p) for p in payloads))
        self.metrics.transfer_seconds.labels("prefill", "handoff_out").observe(time.perf_counter() - start)
        self.metrics.transfer_seconds.labels("prefill", "handoff_exposed").observe(time.perf_counter() - start)

    async def _finish_layerwise(self, streamed: LayerwiseHandoff, firsts: list[int], finished: list[int]) -> None:
        """A layer-wise handoff's end: the first tokens, then decode's reply. Metrics: every byte
        (``handoff_out``), those sent before the last layer was computed (``handoff_hidden``),
        and the seconds from here (the first token is out) to the reply (``handoff_exposed``:
        what the request waits for after its first token, the whole handoff in the other path)."""
        start = time.perf_counter()
        await streamed.finish(firsts, finished)
        self._count_copied(streamed.export)
        m = self.metrics
        m.transfer_bytes.labels("prefill", "handoff_out").inc(streamed.bytes_sent)
        m.transfer_bytes.labels("prefill", "handoff_hidden").inc(streamed.bytes_early)
        m.transfer_seconds.labels("prefill", "handoff_exposed").observe(time.perf_counter() - start)

    def _count_copied(self, export: PromptExport) -> None:
        """KV bytes copied out of the cache since the last count (each block once, whoever asked)."""
        copied, export.copied_bytes = export.copied_bytes, 0
        if copied:
            self.metrics.transfer_bytes.labels("prefill", "copied_out").inc(copied)

    def _handoff_header(self, request: prefill_pb2.PrefillRequest, firsts: list[int],
                        finished: list[int]) -> decode_pb2.HandoffHeader:
        return decode_pb2.HandoffHeader(
            request_id=request.request_id, model_id=self.engine.model_id, prompt_token_ids=request.token_ids,
            first_token_id=firsts[0], sampling=request.sampling, kv_dtype=kv_dtype(self.engine.cache),
            kv_block_shape=list(self.engine.cache.block_shape), num_blocks=-(-len(request.token_ids) // self.engine.page_size),
            first_token_ids=firsts if len(firsts) > 1 else [], finished_choices=finished,
        )

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)


def _fan_out(hooks):  # noqa: ANN001, ANN202 - layer hooks: (layer, end) -> None
    """One layer hook that calls each of ``hooks`` (the handoff's and the kvstore export's)."""
    def on_layer(layer: int, end: int) -> None:
        for hook in hooks:
            hook(layer, end)
    return on_layer


def _log_failure(task: asyncio.Task[None]) -> None:
    """A background task's exception is logged, not lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
