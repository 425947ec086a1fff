"""What a prefill instance does with one prompt, without gRPC: attach -> compute -> first tokens
-> export -> hand off (``PrefillServicer`` converts the messages around it).

- **attach**: the longest locally cached prefix (``Engine.add_sequence``), then blocks a peer
  holds beyond it (hot-prefix replication, ``prefix_pull.py``), then the kvstore's;
- **compute**: the rest of the prompt, its chunks sharing forwards with other queued prompts'
  (``PrefillBatcher``); by default a layer-wise handoff to decode (``layerwise.py``) and a
  layer-wise kvstore export (``layerwise_store.py``) ride on the engine's layer hook meanwhile;
- **first tokens**: every choice's from the prompt's last logits (choice i with
  ``choice_seed(seed, i)``), yielded as ``FirstToken``s at once;
- **export**: the new full blocks into the kvstore in the background, not tied to the call (what
  a layer-wise export did not store, whole);
  with the KV pool on a GPU and the node's GPU tier on the same one, the attach and the export
  move blocks device to device instead (``device_store.py``; no layer-wise export then);
- **hand off**: the request and its KV to decode through a ``HandoffSink`` (decode's Handoff
  call; a test's fake), once — the layer-wise stream's tail, or the whole blocks; then
  ``HandedOff``. A failure is a ``HandoffFailed`` carrying the sink's error.

A ``PromptRun`` is one prompt's pass; its ``close`` (always awaited by the caller) stops what
still reads the prompt's pages and lets them go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, prefill_pb2
from crescent.services.contract.choices import choice_seed
from crescent.services.contract.finish import finish_reason, stop_token_ids
from crescent.services.engine.constraints import Constraints, compile_constraint, submit_masks
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.engine.logprobs import TokenLogprob, batch_logprobs
from crescent.services.engine.sampler import sample_batch
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import block_matches, block_tensor, kv_dtype, sampling_config
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.handoff_wire import handoff_parts
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.kvwire.movers import GRPC
from crescent.services.prefill.device_store import DeviceStore
from crescent.services.prefill.handoff_mover import HandoffMovers
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.prefix_pull import PrefixPuller
from crescent.services.prefill.prompt_export import PromptExport

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine], None]  # runs a background task its owner awaits or cancels
LayerHook = Callable[[int, int], None]


class HandoffSink(Protocol):
    """Where prompts are handed off: decode's ``Handoff`` and ``OpenHandoff`` at an address, as
    callables (``(parts, timeout=...)`` -> awaitable ``HandoffReply``; ``(request, timeout=...)``
    -> awaitable ``OpenHandoffReply``). Their failures raise ``grpc.aio.AioRpcError``."""

    def handoff(self, address: str) -> Callable: ...

    def open_handoff(self, address: str) -> Callable: ...


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One choice's first token, as the gateway streams it."""

    index: int
    token_id: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # "stop", "length", or "" (it goes on to decode)
    logprob: TokenLogprob | None


@dataclass(frozen=True, slots=True)
class HandedOff:
    decode_address: str


class HandoffFailed(Exception):
    """The handoff to decode failed; ``cause`` is the sink's error (an ``AioRpcError``), or a
    ``TimeoutError`` when a layer-wise handoff's reply did not come."""

    def __init__(self, address: str, cause: BaseException) -> None:
        if isinstance(cause, grpc.aio.AioRpcError):
            why = f"{cause.code().name}: {cause.details()}"
        else:
            why = "no reply"
        super().__init__(f"handoff to decode {address} failed: {why}")
        self.cause = cause


class PageHold:
    """A sequence's pages go back once every holder (the call, the kvstore export) lets go."""

    def __init__(self, worker: EngineWorker, release, seq: Sequence, after_release) -> None:  # noqa: ANN001
        self._worker, self._release, self._seq, self._after = worker, release, seq, after_release
        self._holders = 1

    def acquire(self) -> None:
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._worker.submit(self._release, self._seq)
            self._after()


@dataclass(frozen=True, slots=True)
class Hits:
    """Prompt tokens that came from a cache, by where."""

    local: int
    peer: int
    kvstore: int

    @property
    def total(self) -> int:
        return self.local + self.peer + self.kvstore


class PrefillPipeline:
    """One prefill instance's prompt path; ``start`` a ``PromptRun`` per request."""

    def __init__(self, *, engine: Engine, worker: EngineWorker, batcher, metrics,  # noqa: ANN001
                 load: PrefillLoad,
                 sink: HandoffSink, spawn: Spawn, kvstore: KvStoreClient | None = None, lease_ms: int = 0,
                 on_blocks_stored: Callable[[], None] = lambda: None, constraints: Constraints | None = None,
                 puller: PrefixPuller | None = None, layerwise_handoff: bool = False,
                 layerwise_kvstore: bool = False, handoff_movers: HandoffMovers | None = None,
                 device_blocks: DeviceBlocks | None = None) -> None:
        """``batcher``: computes prompts (``prefill(seq, on_layer)``); ``metrics``: the role's
        ``engine_metrics``; ``spawn``: runs the background kvstore export; the flags as
        ``PrefillServicer``'s (already narrowed to what the cache and the kvstore allow);
        ``device_blocks``: the pool's blocks as device rooms (None on the CPU): the kvstore export
        and prefix load go device to device while the node takes them (``device_store.py``)."""
        self.engine, self.worker, self.batcher = engine, worker, batcher
        self.metrics, self.load = metrics, load
        self.sink, self.spawn, self.kvstore, self.lease_ms = sink, spawn, kvstore, lease_ms
        self.on_blocks_stored, self.constraints, self.puller = on_blocks_stored, constraints, puller
        self.layerwise_handoff, self.layerwise_kvstore = layerwise_handoff, layerwise_kvstore
        self.handoff_movers = handoff_movers
        self.device = (DeviceStore(engine, worker, kvstore, device_blocks, metrics)
                       if device_blocks is not None and kvstore is not None else None)

    @property
    def on_device(self) -> bool:
        """Whether the kvstore's blocks move device to device now (``device_store.py``)."""
        return self.device is not None and self.device.open

    def start(self, request: prefill_pb2.PrefillRequest) -> PromptRun:
        """A pass of ``request`` (already checked); iterate its ``events()``, then ``close`` it."""
        return PromptRun(self, request)

    # ---- what an aggregated instance changes (services/aggregated/servicer.py) -----------------

    async def compute_logits(self, seq: Sequence, on_layer: LayerHook | None = None) -> torch.Tensor:
        """Compute the prompt (its chunks in forwards shared with other queued prompts'); its
        last token's logits (vocab,). ``on_layer``: the layer-wise handoff's and export's hook."""
        return await self.batcher.prefill(seq, on_layer)

    async def hand_off_whole(self, request: prefill_pb2.PrefillRequest, seq: Sequence, firsts: list[int],
                             finished: list[int], hold: PageHold, export: PromptExport) -> None:
        """Push the request (every choice's first token) and the prompt's KV, once, to decode.
        (``hold`` keeps the prompt's pages; an in-process handoff holds them longer.) The
        payloads are ``export``'s: blocks the kvstore export copied already are not copied again."""
        start = time.perf_counter()
        payloads = await export.payloads(range(export.num_blocks))
        self.count_copied(export)
        cache = self.engine.cache
        blocks = [
            (common_pb2.BlockMeta(key=f"{request.request_id}/{i}".encode(), model_id=self.engine.model_id,
                                  dtype=kv_dtype(cache), shape=list(export.shape(i)),
                                  nbytes=len(payload), found=True), payload)
            for i, payload in enumerate(payloads)
        ]
        parts = handoff_parts(self.handoff_header(request, firsts, finished), blocks)
        await self.sink.handoff(request.decode_address)(parts, timeout=60)
        nbytes = sum(len(p) for p in payloads)
        if self.handoff_movers is not None:
            self.handoff_movers.handed_off(request.decode_address, GRPC, nbytes)
        m = self.metrics
        m.transfer_bytes.labels("prefill", "handoff_out").inc(nbytes)
        m.transfer_seconds.labels("prefill", "handoff_out").observe(time.perf_counter() - start)
        m.transfer_seconds.labels("prefill", "handoff_exposed").observe(time.perf_counter() - start)

    # ---- shared by every run --------------------------------------------------------------------

    def handoff_header(self, request: prefill_pb2.PrefillRequest, firsts: list[int],
                       finished: list[int]) -> decode_pb2.HandoffHeader:
        engine = self.engine
        return decode_pb2.HandoffHeader(
            request_id=request.request_id, model_id=engine.model_id, prompt_token_ids=request.token_ids,
            first_token_id=firsts[0], sampling=request.sampling, kv_dtype=kv_dtype(engine.cache),
            kv_block_shape=list(engine.cache.block_shape),
            num_blocks=-(-len(request.token_ids) // engine.block_size),
            first_token_ids=firsts if len(firsts) > 1 else [], finished_choices=finished,
        )

    def count_copied(self, export: PromptExport) -> None:
        """KV bytes copied out of the cache since the last count (each block once, whoever asked)."""
        copied, export.copied_bytes = export.copied_bytes, 0
        if copied:
            self.metrics.transfer_bytes.labels("prefill", "copied_out").inc(copied)

    def count_tokens(self, prompt: int, hits: Hits) -> None:
        m = self.metrics
        m.prompt_tokens.labels("prefill").inc(prompt)
        m.cached_tokens.labels("prefill", "local").inc(hits.local)
        m.cached_tokens.labels("prefill", "kvstore").inc(hits.kvstore)
        m.cached_tokens.labels("prefill", "peer").inc(hits.peer)
        m.computed_tokens.labels("prefill").inc(prompt - hits.total)


class PromptRun:
    """One prompt's pass through the pipeline: ``events()`` once, then ``close()`` always."""

    def __init__(self, pipeline: PrefillPipeline, request: prefill_pb2.PrefillRequest) -> None:
        self.p, self.request = pipeline, request
        self.seq: Sequence | None = None
        self.hold: PageHold | None = None
        self.streamed: LayerwiseHandoff | None = None
        self.layered: LayerwiseStoreExport | None = None  # stopped in the end unless the store export took it

    async def events(self) -> AsyncIterator[FirstToken | HandedOff]:
        """The first tokens (one per choice), then ``HandedOff`` unless every choice ended at its
        first token. Raises ``ConstraintError``, ``CacheFullError``, ``HandoffFailed``."""
        p, request = self.p, self.request
        engine, sampling_msg = p.engine, request.sampling
        tokens = list(request.token_ids)
        n = max(sampling_msg.n, 1)
        # attach: a moved request's streamed tokens are computed as decode computed them (bit for bit)
        seq = self.seq = await p.worker.run(engine.add_sequence, request.request_id, tokens,
                                            salt=request.cache_salt,
                                            decode_tail=max(sampling_msg.first_step, 0),
                                            orphan=engine.release)
        self.hold = PageHold(p.worker, engine.release, seq, p.on_blocks_stored)
        hits = Hits(local=seq.num_cached, peer=await self._pull_from_peer(seq), kvstore=0)
        hits = replace(hits, kvstore=await self._attach_from_kvstore(seq))
        p.load.cached(request.request_id, seq.num_cached)
        stop_ids = stop_token_ids(sampling_msg.stop_token_ids, engine.config.eos_token_ids,
                                  sampling_msg.ignore_eos)
        step = max(sampling_msg.first_step, 0)  # after a migration: the client has that many tokens
        constraint = await compile_constraint(p.constraints, sampling_msg, tokens[len(tokens) - step:])
        start = time.perf_counter()
        sampling = sampling_config(sampling_msg, stop_ids)
        # n > 1: every choice's first token from the same logits, each with its own seed.
        cfgs = [replace(sampling, seed=choice_seed(sampling.seed, i)) for i in range(n)]
        p.load.computing(request.request_id)
        # the constraint's mask is computed while the forward runs
        mask = submit_masks([constraint]) if constraint is not None else None
        export = PromptExport(engine, p.worker, seq, len(tokens))  # one copy for kvstore and handoff

        # compute, with the layer-wise handoff and export riding on the layer hook
        hands_off = bool(request.decode_address) and sampling_msg.max_tokens != 1
        if p.layerwise_handoff and hands_off:
            self.streamed = LayerwiseHandoff(engine, seq, export, p.handoff_header(request, [0], []),
                                             p.handoff_movers, request.decode_address)
            address = request.decode_address
            self.streamed.start(p.sink.handoff(address), p.sink.open_handoff(address))
        self.layered = self._layered_export(seq, hits.total)
        hooks = [h.on_layer for h in (self.streamed, self.layered) if h is not None]
        logits = await p.compute_logits(seq, _fan_out(hooks) if hooks else None)
        computed_at = time.perf_counter()

        # first tokens
        def sample_firsts() -> tuple[list[int], list[TokenLogprob | None]]:
            rows = logits[None].repeat(n, 1)
            firsts = sample_batch(rows, cfgs, [step] * n, [tokens] * n, mask.result() * n if mask else None)
            return firsts, batch_logprobs(rows, firsts, [c.logprobs for c in cfgs])

        firsts, logprobs = await p.worker.run(sample_firsts)
        p.load.done(request.request_id)
        p.metrics.step_seconds.labels("prefill").observe(time.perf_counter() - start)
        p.count_tokens(len(tokens), hits)
        reasons = [finish_reason(first, 1, sampling_msg.max_tokens, stop_ids) for first in firsts]
        finished = [i for i, reason in enumerate(reasons) if reason is not None]

        # export: not tied to this call, the blocks are worth keeping even if the client has gone
        if p.kvstore is not None:
            self.hold.acquire()
            p.spawn(self._store_new_blocks(seq, hits.total, export, self.layered, computed_at))
            self.layered = None
        for i, (first, logprob) in enumerate(zip(firsts, logprobs)):
            yield FirstToken(i, first, len(tokens), seq.num_cached, reasons[i] or "", logprob)

        # hand off
        if len(finished) < n:
            try:
                if self.streamed is not None:
                    await self._finish_layerwise(self.streamed, firsts, finished)
                else:
                    await p.hand_off_whole(request, seq, firsts, finished, self.hold, export)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:  # Timeout: a layer-wise handoff's reply
                raise HandoffFailed(request.decode_address, exc) from exc
            yield HandedOff(request.decode_address)

    async def close(self) -> None:
        """Stop what still reads the prompt's pages (a layer-wise stream, an export the store
        task did not take), then let the call's hold on them go."""
        if self.streamed is not None:
            await self.streamed.close()  # before the pages go back: the stream reads them
        if self.layered is not None:
            await self.layered.close()  # no copy out of the pages after this; its room goes back
        if self.hold is not None:
            self.hold.release()

    # ---- attach ------------------------------------------------------------------------------

    async def _pull_from_peer(self, seq: Sequence) -> int:
        """Prefix blocks the placement says a peer holds beyond our own: pull and keep them."""
        request, puller = self.request, self.p.puller
        if puller is None or not request.prefix_source_id or request.prefix_source_blocks <= 0:
            return 0
        return await puller.pull(seq, request.prefix_source_id, request.prefix_source_blocks,
                                 address=request.prefix_source_address)

    async def _attach_from_kvstore(self, seq: Sequence) -> int:
        p = self.p
        engine, block_size = p.engine, p.engine.block_size
        if p.kvstore is None:
            return 0
        on_device = 0
        if p.on_device:  # the rest (after a miss) the host way: it may be on the node's peers
            assert p.device is not None
            on_device, missed = await p.device.attach(seq, engine.missing_prefix_keys(seq), p.lease_ms)
            if not missed:
                return on_device
        keys = engine.missing_prefix_keys(seq)
        if not keys:
            return on_device
        start = time.perf_counter()
        blocks = await p.kvstore.get_prefix(keys, engine.model_id, lease_ms=p.lease_ms)
        first_block = seq.num_computed // block_size
        usable = []
        for i, block in enumerate(blocks):
            expected = seq.token_ids[(first_block + i) * block_size : (first_block + i + 1) * block_size]
            if not block_matches(block, keys[i], expected, engine.cache):
                log.warning("kvstore block %s does not match the prompt; recomputing from there",
                            block.key.hex())
                break
            usable.append(block_tensor(block, tuple(block.shape)))
        added = await p.worker.run(engine.attach_blocks, seq, usable) if usable else 0
        if added:
            nbytes = sum(b.nbytes for b in blocks[: len(usable)])
            p.metrics.transfer_bytes.labels("prefill", "from_kvstore").inc(nbytes)
            p.metrics.transfer_seconds.labels("prefill", "from_kvstore").observe(time.perf_counter() - start)
        return on_device + added

    # ---- export ------------------------------------------------------------------------------

    def _layered_export(self, seq: Sequence, already_cached: int) -> LayerwiseStoreExport | None:
        """A layer-wise export of the prompt's new blocks, started. With a layer-wise handoff
        streaming beside it, the export reads the layers the handoff copied out of the cache."""
        p = self.p
        if not p.layerwise_kvstore or p.on_device:  # device to device needs no layer-wise staging
            return None
        assert p.kvstore is not None  # layerwise_kvstore is on only with a kvstore
        layered = LayerwiseStoreExport(p.engine, seq, already_cached, p.kvstore, source=self.streamed)
        if not layered.wanted:
            return None
        layered.start(p.spawn)
        return layered

    async def _export_new_blocks(self, seq: Sequence, already_cached: int, export: PromptExport,
                                 only: list[int] | None = None) -> list[KvBlock]:
        """The prompt's full blocks that came from neither cache (``only`` these, if given), for
        the kvstore (none for a prompt too short to be cached: ``Engine.min_cached_prompt_tokens``);
        their payloads are the ones the handoff sends."""
        engine = self.p.engine
        if self.p.kvstore is None or not seq.keeps_blocks:
            return []
        block_size = engine.block_size
        indices = range(already_cached // block_size, len(seq.block_keys)) if only is None else only
        payloads = await export.payloads(indices)
        return [
            KvBlock.build(seq.block_keys[i], seq.block_keys[i - 1] if i else None, engine.model_id,
                          kv_dtype(engine.cache), export.shape(i), seq.token_ids[i * block_size : (i + 1) * block_size],
                          payload)
            for i, payload in zip(indices, payloads)
        ]

    async def _store_new_blocks(self, seq: Sequence, already_cached: int, export: PromptExport,
                                layered: LayerwiseStoreExport | None, computed_at: float) -> None:
        """The new blocks into the kvstore: what a layer-wise export did not store, whole.
        Metrics: ``to_kvstore_exposed``, the seconds from the prompt computed to its new blocks
        stored; ``to_kvstore_hidden``, the bytes written before its last layer was computed."""
        p = self.p
        assert self.hold is not None
        if layered is None and p.on_device:
            assert p.device is not None
            await p.device.store(seq, already_cached, self.hold.release, computed_at)
            return
        try:
            left = await layered.finished() if layered is not None else None
            blocks = await self._export_new_blocks(seq, already_cached, export, left)
        finally:
            self.hold.release()
        p.count_copied(export)
        m = p.metrics
        if layered is not None:
            m.transfer_bytes.labels("prefill", "to_kvstore").inc(layered.bytes_written)
            m.transfer_bytes.labels("prefill", "to_kvstore_hidden").inc(layered.bytes_early)
            m.transfer_bytes.labels("prefill", "copied_out").inc(layered.bytes_from_cache)
        if blocks:
            await self._store_blocks(blocks)
        if blocks or (layered is not None and layered.bytes_written):
            exposed = time.perf_counter() - computed_at
            m.transfer_seconds.labels("prefill", "to_kvstore_exposed").observe(exposed)

    async def _store_blocks(self, blocks: list[KvBlock]) -> None:
        kvstore = self.p.kvstore
        assert kvstore is not None
        start = time.perf_counter()
        result = await kvstore.put(blocks)
        if result.rejected:
            log.warning("kvstore kept %d of %d new blocks", result.stored, len(blocks))
        self.p.metrics.transfer_bytes.labels("prefill", "to_kvstore").inc(sum(b.nbytes for b in blocks))
        self.p.metrics.transfer_seconds.labels("prefill", "to_kvstore").observe(time.perf_counter() - start)

    # ---- hand off ----------------------------------------------------------------------------

    async def _finish_layerwise(self, streamed: LayerwiseHandoff, firsts: list[int],
                                finished: list[int]) -> None:
        """A layer-wise handoff's end: the first tokens, then decode's reply. Metrics: every byte
        (``handoff_out``), those sent before the last layer was computed (``handoff_hidden``),
        and the seconds from here (the first token is out) to the reply (``handoff_exposed``:
        what the request waits for after its first token, the whole handoff in the other path)."""
        start = time.perf_counter()
        await streamed.finish(firsts, finished)
        self.p.count_copied(streamed.export)
        m = self.p.metrics
        m.transfer_bytes.labels("prefill", "handoff_out").inc(streamed.bytes_sent)
        m.transfer_bytes.labels("prefill", "handoff_hidden").inc(streamed.bytes_early)
        m.transfer_seconds.labels("prefill", "handoff_exposed").observe(time.perf_counter() - start)


def _fan_out(hooks: list[LayerHook]) -> LayerHook:
    """One layer hook that calls each of ``hooks`` (the handoff's and the kvstore export's)."""
    def on_layer(layer: int, end: int) -> None:
        for hook in hooks:
            hook(layer, end)
    return on_layer
