"""Prefill as an aggregated instance does it: the prompt reserves its request's KV first, is
computed in chunks mixed into decode steps, and is handed over in-process when the placement
decodes it here (``MixedBatcher``). Everything else is prefill's own: prefix cache, kvstore,
peers, sampling of the first tokens, and a gRPC handoff when decode is elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import torch

from crescent.protos import prefill_pb2
from crescent.services.aggregated.batcher import MixedBatcher
from crescent.services.contract.choices import reserve_tokens
from crescent.services.decode.request import DecodeRequest
from crescent.services.decode.pipeline import never_fits_message
from crescent.services.decode.servicer import DecodeServicer
from crescent.services.engine.engine import Sequence
from crescent.services.prefill.pipeline import PageHold, PrefillPipeline
from crescent.services.prefill.prompt_export import PromptExport
from crescent.services.prefill.servicer import PrefillServicer


class AggregatedPrefillServicer(PrefillServicer):
    def __init__(self, *args, batcher: MixedBatcher, decode: DecodeServicer, own_address: Callable[[], str],
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batcher = batcher
        self.decode = decode
        self.pipeline = AggregatedPipeline(**self._pipeline_args(), decode=decode, own_address=own_address)

    async def _admit_prompt(self, request: prefill_pb2.PrefillRequest,
                            context: grpc.aio.ServicerContext) -> None:
        if self.batcher.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this instance takes no new requests")
        if self.batcher.holds(request.request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request.request_id} is already here")
        prompt = len(request.token_ids)
        max_tokens = max(request.sampling.max_tokens, 1)
        reserve = reserve_tokens(prompt, max_tokens, self.engine.config.max_position_embeddings)
        choices = max(request.sampling.n, 1)
        pages = self.batcher.prompt_pages(prompt, reserve, choices)
        if pages > self.batcher.ledger.num_pages:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, never_fits_message(
                prompt, max_tokens, reserve, choices, self.engine.cache.capacity_tokens,
                where="this instance"))
        await self.batcher.reserve_prompt(request.request_id, pages)

    def _prompt_left(self, request_id: str) -> None:
        self.batcher.release_prompt(request_id)


class AggregatedPipeline(PrefillPipeline):
    """The prompt path computed in chunks mixed into decode steps, handed over in-process when
    the placement decodes it here."""

    def __init__(self, *, decode: DecodeServicer, own_address: Callable[[], str],
                 **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.decode = decode
        self._own_address = own_address  # what the scheduler knows this instance by

    async def compute_logits(self, seq: Sequence, on_layer=None) -> torch.Tensor:  # noqa: ANN001
        assert on_layer is None, "an aggregated instance hands off in process, not layer-wise"
        return await self.batcher.prefill(seq)

    async def hand_off_whole(self, request: prefill_pb2.PrefillRequest, seq: Sequence, firsts: list[int],
                             finished: list[int], hold: PageHold, export: PromptExport) -> None:
        if request.decode_address != self._own_address():
            await super().hand_off_whole(request, seq, firsts, finished, hold, export)
            return
        header = self.handoff_header(request, firsts, finished)
        accepted = await self.decode.accept(header, None, _LocalContext(), local_prompt=seq)
        # The prompt's pages stay until its choices hold them, even if this call is cancelled now.
        hold.acquire()
        self.spawn(_release_when_adopted(accepted, hold))
        await accepted.adopted.wait()


async def _release_when_adopted(request: DecodeRequest, hold: PageHold) -> None:
    try:
        await request.adopted.wait()
    finally:
        hold.release()


class _LocalContext:
    """What ``DecodeServicer.accept`` aborts through when the handoff is in-process: the same
    refusal a gRPC handoff gets, raised here, which ends the Prefill call as a failed handoff."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise LocalHandoffRefused(code, details)


class LocalHandoffRefused(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
