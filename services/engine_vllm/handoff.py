"""Prefill and decode pools on vLLM: the prompt's KV goes from a vLLM prefill to a vLLM decode
through the node's kvstore, as Mooncake's store-based vLLM integration moves it.

Prefill (``VllmPrefillServicer.Prefill``) computes the prompt in vLLM (one token, thrown away);
Crescent's connector saves each complete block as its layers finish, and a prefill instance's
saves wait for room rather than drop. Once the kvstore holds the blocks decode will ask for, it
sends decode's ``Handoff`` one header: the request, no KV, and the vLLM cache salt the blocks lie
under (``HandoffHeader.vllm_cache_salt``). Decode (``VllmDecodeServicer.Handoff``) starts the
request's choices in its own vLLM with that salt: the connector loads the blocks, vLLM computes
the rest (the last, partial block and the last token), samples each choice's first token, and the
reply carries them back to prefill, which reports them to the gateway and names decode in
``HandedOff``. The stream then runs on decode as on an aggregated instance.

A hybrid model (recurrent layers beside attention) resumes only from a recurrent-state snapshot
at a block boundary: prefill's connector names the blocks up to the last snapshot it saved and
that snapshot (vLLM's ``kv_transfer_params``, connector_scheduler.HANDOFF_KEYS), and prefill
waits for exactly those keys; decode's connector loads them and vLLM computes from that boundary.

Decode samples the first tokens, as in vLLM's own disaggregated serving, so a choice's whole
sequence comes from one vLLM request: seeds, penalties, logprobs and structured outputs are
exactly an aggregated instance's. What it costs: a block missing from the kvstore is computed on
decode (a miss, never wrong output), and TTFT includes decode's first step.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from crescent.protos import decode_pb2, decode_pb2_grpc, prefill_pb2
from crescent.services.common.grpc_service import ChannelPool
from crescent.services.common.logs import request_id_var
from crescent.services.common.tls import PeerTls
from crescent.services.decode.request import ABORTED
from crescent.services.engine_vllm.requests import HeldRequest
from crescent.services.engine_vllm.connector_options import (
    HANDOFF_SALT_PREFIX, TENANT_SALT_PREFIX, crescent_salt, loadable_blocks,
)
from crescent.services.engine_vllm.connector_scheduler import HANDOFF_KEYS
from crescent.services.engine_vllm.servicer import VllmServicer, first_token_message
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.contract.block_keys import prefix_block_keys

log = logging.getLogger(__name__)

STORE_POLL_S = 0.005      # how often prefill asks the kvstore whether the prompt's blocks landed
STORE_STALL_S = 1.0       # no block landed for this long: hand off anyway (decode computes the rest)
STORE_WAIT_MAX_S = 10.0

# Decode's refusals as prefill passes them on (the gateway re-places on UNAVAILABLE).
_HANDOFF_FAILURES = {
    grpc.StatusCode.ABORTED: grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,  # the request itself (vLLM refused it)
    grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.INTERNAL,       # decode is not a vLLM one
    grpc.StatusCode.ALREADY_EXISTS: grpc.StatusCode.INTERNAL,
}


class VllmPrefillServicer(VllmServicer):
    """A prefill instance: computes prompts and hands them to the decode the scheduler chose."""

    def __init__(self, llm, facts, *, store: KvStoreClient, tls: PeerTls | None, **kwargs) -> None:  # noqa: ANN001, ANN003
        super().__init__(llm, facts, **kwargs)
        self.store = store
        self._decode_channels = ChannelPool(tls)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        rid = request.request_id
        tokens = list(request.token_ids)
        await self._admit(rid, request.model_id, tokens, request.sampling, context)  # decode admits again
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is required")
        salt = self._salt(request.sampling, request.cache_salt, len(tokens), private_prefix=HANDOFF_SALT_PREFIX)
        held = HeldRequest(rid, len(tokens), len(tokens))  # its KV here: the prompt's, until vLLM evicts it
        self.requests[rid] = held
        self.on_change()
        try:
            cached, resume_keys = await self._compute(rid, tokens, salt, context)
            await self._wait_for_blocks(tokens, salt, resume_keys)
            reply = await self._hand_off(request, tokens, salt, context)
        finally:
            self._forget(rid)
        log.info("handed %s to decode %s: %d prompt tokens, %d cached here, %d loaded or cached there", rid,
                 request.decode_address, len(tokens), cached, reply.first_tokens[0].cached_tokens)
        for index, first in enumerate(reply.first_tokens):
            first.prompt_tokens, first.cached_tokens, first.index = len(tokens), cached, index
            yield prefill_pb2.PrefillEvent(first_token=first)
        if not all(first.finished for first in reply.first_tokens):
            yield prefill_pb2.PrefillEvent(handed_off=prefill_pb2.HandedOff(decode_address=request.decode_address))

    async def _compute(self, rid: str, tokens: list[int], salt: str,
                       context: grpc.aio.ServicerContext) -> tuple[int, list[bytes] | None]:
        """The prompt through vLLM (the connector saves its blocks): the prompt tokens it did not
        compute, and for a hybrid model the keys decode resumes from (None: not a hybrid model)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        cached, resume_keys = 0, None
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=tokens, cache_salt=salt), params,
                                               request_id=f"{rid}#prefill"):
                cached = out.num_cached_tokens or 0
                named = (out.kv_transfer_params or {}).get(HANDOFF_KEYS)
                if named is not None:
                    resume_keys = [bytes.fromhex(key) for key in named]
        except (ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the vLLM engine refused the request: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request %s failed in vLLM", rid)
            await context.abort(grpc.StatusCode.INTERNAL, f"the vLLM engine failed: {exc}")
        return cached, resume_keys

    async def _wait_for_blocks(self, tokens: list[int], salt: str, resume_keys: list[bytes] | None) -> None:
        """Until the kvstore holds what decode will load — the leading blocks (every complete
        block but one ending at the last token), or a hybrid model's ``resume_keys`` (blocks and
        the snapshot after the last) — or until none has landed for ``STORE_STALL_S``."""
        if resume_keys is not None:
            keys = resume_keys
        else:
            usable = loadable_blocks(len(tokens), self.facts.block_size)
            key_salt = crescent_salt(salt)
            if not usable or key_salt is None:
                return
            keys = prefix_block_keys(tokens, self.facts.block_size, self.facts.model_id, key_salt)[:usable]
        if not keys:
            log.info("no recurrent-state snapshot within the prompt's loadable blocks: decode computes it all")
            return
        start = last_progress = time.monotonic()
        held = -1
        while True:
            try:
                found = await self.store.exists(keys, self.facts.model_id)
            except Exception as exc:  # noqa: BLE001 - a store that cannot answer: decode computes it all
                log.warning("kvstore lookup before a handoff failed: %s", exc)
                return
            leading = next((i for i, present in enumerate(found) if not present), len(found))
            now = time.monotonic()
            if leading == len(keys):
                return
            if leading > held:
                held, last_progress = leading, now
            if now - last_progress >= STORE_STALL_S or now - start >= STORE_WAIT_MAX_S:
                log.warning("the kvstore holds %d of the %d blocks decode loads; decode computes the rest", leading, len(keys))
                return
            await asyncio.sleep(STORE_POLL_S)

    async def _hand_off(self, request: prefill_pb2.PrefillRequest, tokens: list[int], salt: str,
                        context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:
        header = decode_pb2.HandoffHeader(request_id=request.request_id, model_id=self.facts.model_id,
                                          prompt_token_ids=tokens, sampling=request.sampling,
                                          kv_dtype=self.facts.kv_dtype, vllm_cache_salt=salt)
        stub = decode_pb2_grpc.DecodeStub(self._decode_channels.get(request.decode_address))
        try:
            reply = await stub.Handoff(iter([decode_pb2.HandoffPart(header=header)]))
        except grpc.aio.AioRpcError as exc:
            code = _HANDOFF_FAILURES.get(exc.code(), grpc.StatusCode.UNAVAILABLE)
            log.warning("handoff to decode %s failed: %s %s", request.decode_address, exc.code().name, exc.details())
            await context.abort(code, f"handoff to decode {request.decode_address} failed: "
                                      f"{exc.code().name}: {exc.details()}")
        if not reply.first_tokens:
            await context.abort(grpc.StatusCode.INTERNAL, f"decode {request.decode_address} answered no first "
                                                          "tokens: it is not a vLLM-backed decode")
        return reply

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a prefill instance streams no tokens")
        yield  # noqa: B901 - a generator, as the service's method is

    async def close(self) -> None:
        await super().close()
        await self._decode_channels.close()
        await self.store.close()


class VllmDecodeServicer(VllmServicer):
    """A decode instance: takes a vLLM prefill's handoffs, samples and streams."""

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a decode instance takes handoffs, not prompts")
        yield  # noqa: B901

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:  # noqa: ANN001
        header = None
        async for part in request_iterator:  # handoff_wire's parts (the server's deserializer)
            if part.header is None or header is not None or part.error:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "a vLLM-backed decode takes a vLLM prefill's handoff: one header, no KV")
            header = part.header
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty handoff")
        request_id_var.set(header.request_id)
        salt = header.vllm_cache_salt
        if not salt.startswith((TENANT_SALT_PREFIX, HANDOFF_SALT_PREFIX)) or crescent_salt(salt) is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "a vLLM-backed decode takes a vLLM prefill's handoff (vllm_cache_salt), not KV blocks")
        rid, tokens = header.request_id, list(header.prompt_token_ids)
        params = await self._admit(rid, header.model_id, tokens, header.sampling, context)
        held = self._hold(rid, tokens, header.sampling, len(params))
        handed = False
        try:
            firsts = await self._start_choices(held, TokensPrompt(prompt_token_ids=tokens, cache_salt=salt), params, context)
            self._await_reader(held, firsts)
            handed = True
        finally:
            if not handed:
                self._drop(held, ABORTED, "handoff call ended before the first tokens")
        return decode_pb2.HandoffReply(accepted=True, first_tokens=[
            first_token_message(first, index, len(tokens), first.cached_tokens) for index, first in enumerate(firsts)])
