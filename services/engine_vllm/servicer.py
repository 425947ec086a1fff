"""The Prefill and Decode services of an aggregated instance whose engine is vLLM (the prefill
and decode roles on vLLM subclass it: handoff.py).

The gateway drives it exactly as a native aggregated instance: ``Prefill`` answers each choice's
first token and ``HandedOff`` naming this instance, then ``StreamTokens`` streams the rest,
``Abort`` ends a request or one choice. The prompt is never handed to another process: vLLM
decodes where it prefilled (``HandedOff`` carries this address, which the gateway follows), so
there is no KV handoff to take (``Handoff``/``OpenHandoff`` refuse with FAILED_PRECONDITION).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import grpc
from vllm.inputs import TokensPrompt

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from crescent.services.contract.choices import MAX_CHOICES, reserve_tokens
from crescent.services.common.logs import request_id_var
from crescent.services.decode.pipeline import coalesced, never_fits_message
from crescent.services.engine_vllm.connector_options import PRIVATE_SALT_PREFIX, tenant_salt
from crescent.services.engine_vllm.engine import BackendFacts
from crescent.services.decode.request import ABORTED, DRAINING, ENDINGS, ERROR
from crescent.services.engine_vllm.requests import ChoiceState, FirstTokens, HeldRequest, ChoiceUpdate
from crescent.services.engine_vllm.sampling import UnsupportedSampling, vllm_sampling

log = logging.getLogger(__name__)

_STATUS = {ERROR: grpc.StatusCode.INTERNAL, DRAINING: grpc.StatusCode.UNAVAILABLE, ABORTED: grpc.StatusCode.ABORTED}
_CHOICE_ENDED = "choice ended"  # an update that tells the reader a choice ended without a finish


class VllmServicer(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer):
    def __init__(self, llm, facts: BackendFacts, *, own_address: Callable[[], str],  # noqa: ANN001 - AsyncLLM
                 unclaimed_timeout_s: float, min_cached_prompt_tokens: int,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.llm = llm
        self.facts = facts
        self._own_address = own_address
        self.unclaimed_timeout_s = unclaimed_timeout_s
        self.min_cached_prompt_tokens = min_cached_prompt_tokens
        self.on_change = on_change
        self.requests: dict[str, HeldRequest] = {}
        self.left: list[str] = []  # ids that left since the last load report
        self.accepting = True
        self._tasks: set[asyncio.Task] = set()

    # -- Prefill -----------------------------------------------------------------------------------

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        rid = request.request_id
        tokens = list(request.token_ids)
        params = await self._admit(rid, request.model_id, tokens, request.sampling, context)
        held = self._hold(rid, tokens, request.sampling, len(params))
        prompt = TokensPrompt(prompt_token_ids=tokens, cache_salt=self._salt(request.sampling, request.cache_salt, len(tokens)))
        handed = False
        try:
            firsts = await self._start_choices(held, prompt, params, context)
            for index, first in enumerate(firsts):
                yield prefill_pb2.PrefillEvent(first_token=first_token_message(first, index, len(tokens), firsts[0].cached_tokens))
            handed = True
            if self._await_reader(held, firsts):
                yield prefill_pb2.PrefillEvent(handed_off=prefill_pb2.HandedOff(decode_address=self._own_address()))
        finally:
            if not handed:
                self._drop(held, ABORTED, "prefill call ended before the handoff")

    def _hold(self, rid: str, tokens: list[int], sampling: common_pb2.SamplingParams, n: int) -> HeldRequest:
        held = HeldRequest(rid, len(tokens), n * reserve_tokens(len(tokens), max(sampling.max_tokens, 1),
                                                                self.facts.max_model_len))
        self.requests[rid] = held
        self.on_change()
        return held

    async def _start_choices(self, held: HeldRequest, prompt: TokensPrompt, params: list,
                             context: grpc.aio.ServicerContext) -> list[FirstTokens]:
        """Every choice started in vLLM; their first tokens. A failure drops the request and aborts the call."""
        try:
            firsts = [await self._start_choice(held, 0, prompt, params[0])]
            # The others once the first has its first token: the prompt's blocks are cached by then.
            firsts += await asyncio.gather(*(self._start_choice(held, i, prompt, p) for i, p in enumerate(params) if i))
            return firsts
        except (ValueError, TypeError) as exc:  # vLLM refused the input (a grammar it cannot compile, ...)
            self._drop(held, ABORTED, "refused")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the vLLM engine refused the request: {exc}")
        except asyncio.CancelledError:
            self._drop(held, ABORTED, "call cancelled before the first tokens")
            raise
        except Exception as exc:
            self._drop(held, ERROR, str(exc))
            log.exception("request %s failed in vLLM", held.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"the vLLM engine failed: {exc}")
        raise AssertionError("abort raises")

    def _await_reader(self, held: HeldRequest, firsts: list[FirstTokens]) -> bool:
        """After the first tokens: wait for the reader's StreamTokens (True), or forget a request
        whose every choice ended at its first token (False)."""
        held.awaiting = {i for i, first in enumerate(firsts) if first.finish_reason is None}
        if not held.awaiting:
            self._forget(held.request_id)
            return False
        held.handed_off = True
        self._spawn(self._unclaimed_after(held))
        return True

    async def _admit(self, request_id: str, model_id: str, tokens: list[int], sampling: common_pb2.SamplingParams,
                     context: grpc.aio.ServicerContext) -> list:
        """Refuse what cannot run here; the vLLM parameters of each choice."""
        facts = self.facts
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: this instance takes no new requests")
        if model_id and model_id != facts.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this instance serves {facts.model_id!r}, not {model_id!r}")
        if not tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if len(tokens) >= facts.max_model_len:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(tokens)} tokens leave no room in the {facts.max_model_len}-token context")
        if any(t < 0 or t >= facts.vocab_size for t in tokens):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {facts.vocab_size})")
        n = max(sampling.n, 1)
        if n > MAX_CHOICES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n must be in [1, {MAX_CHOICES}]")
        if n > 1 and sampling.first_step > 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n > 1 is for new requests (first_step 0)")
        if request_id in self.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already here")
        max_tokens = max(sampling.max_tokens, 1)
        reserve = n * reserve_tokens(len(tokens), max_tokens, facts.max_model_len)
        if facts.kv_capacity_tokens and reserve > facts.kv_capacity_tokens:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, never_fits_message(
                len(tokens), max_tokens, reserve, n, facts.kv_capacity_tokens, where="this instance"))
        try:
            return [vllm_sampling(sampling, i) for i in range(n)]
        except (UnsupportedSampling, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _salt(self, sampling: common_pb2.SamplingParams, cache_salt: bytes, prompt_tokens: int,
              private_prefix: str = PRIVATE_SALT_PREFIX) -> str:
        """vLLM's cache salt: the tenant's, or a fresh one for a prompt that must leave nothing
        shared (Kimi's rule, counted on the client's prompt: a migrated request's streamed tokens
        do not make it longer)."""
        if prompt_tokens - max(sampling.first_step, 0) <= self.min_cached_prompt_tokens:
            return private_prefix + secrets.token_hex(16)
        return tenant_salt(cache_salt)

    async def _start_choice(self, held: HeldRequest, index: int, prompt: TokensPrompt, params) -> FirstTokens:  # noqa: ANN001
        choice = ChoiceState(index, f"{held.request_id}#{index}", asyncio.get_running_loop().create_future())
        held.choices.append(choice)
        choice.task = self._spawn(self._run_choice(held, choice, prompt, params))
        return await asyncio.shield(choice.first)

    async def _run_choice(self, held: HeldRequest, choice: ChoiceState, prompt: TokensPrompt, params) -> None:  # noqa: ANN001
        try:
            async for out in self.llm.generate(prompt, params, request_id=choice.vllm_id):
                step = out.outputs[0]
                ids = tuple(step.token_ids)
                logprobs = _logprobs(step, ids, params.logprobs)
                finish = _finish_reason(step.finish_reason) if out.finished else None
                if not choice.first.done():
                    if not ids:
                        continue
                    choice.first.set_result(FirstTokens(ids[0], logprobs[0] if logprobs else None,
                                                        out.num_cached_tokens or 0, finish if len(ids) == 1 else None))
                    ids, logprobs = ids[1:], logprobs[1:]
                    if not ids and finish is None:
                        continue
                    if not ids:
                        choice.finished = True
                        return
                held.queue.put_nowait(ChoiceUpdate(choice.index, ids, tuple(logprobs), finish))
                if finish is not None:
                    choice.finished = True
                    self.on_change()
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure ends the request with an error event
            log.exception("choice %d of %s failed in vLLM", choice.index, held.request_id)
            if not choice.first.done():
                choice.first.set_exception(exc)
            else:
                held.queue.put_nowait(ChoiceUpdate(choice.index, (), (), ERROR, str(exc)))

    # -- Decode ------------------------------------------------------------------------------------

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        held = self.requests.get(request.request_id)
        if held is None or not held.handed_off:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id} on this instance")
        if held.claimed:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} is already streaming")
        held.claimed = True
        done = False
        try:
            while held.awaiting:
                updates = [await held.queue.get()]
                while not held.queue.empty():
                    updates.append(held.queue.get_nowait())
                for update in coalesced(updates):
                    if update.finish_reason in ENDINGS:
                        done = True
                        message = "decode draining" if update.finish_reason == DRAINING else update.detail
                        await context.abort(_STATUS[update.finish_reason], message or update.finish_reason)
                    if update.detail == _CHOICE_ENDED:
                        held.awaiting.discard(update.index)
                        continue
                    if update.finish_reason is not None:  # before the yield: the reader may leave at the last event
                        held.awaiting.discard(update.index)
                        done = not held.awaiting
                    yield decode_pb2.TokenEvent(token_ids=update.token_ids, finished=update.finish_reason is not None,
                                                finish_reason=update.finish_reason or "", index=update.index,
                                                logprobs=update.logprobs)
            done = True
        finally:
            if done:
                self._forget(request.request_id)
            else:  # the reader went away: free vLLM's slot and KV now
                self._drop(held, ABORTED, "stream cancelled")

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> decode_pb2.AbortReply:
        request_id_var.set(request.request_id)
        held = self.requests.get(request.request_id)
        if held is None:
            return decode_pb2.AbortReply(found=False)
        why = f"aborted by the caller: {request.reason or 'no reason given'}"
        if request.one_choice:
            choice = held.choice(request.index)
            if choice is not None and not choice.finished:
                log.info("ending choice %d of %s: %s", request.index, request.request_id, why)
                self._stop_choice(choice)
                held.queue.put_nowait(ChoiceUpdate(choice.index, (), (), None, _CHOICE_ENDED))
        else:
            self._drop(held, ABORTED, why)
        return decode_pb2.AbortReply(found=True)

    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:  # noqa: ANN001
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "a vLLM-backed instance decodes what it prefilled; it takes no KV handoffs")

    async def OpenHandoff(self, request: decode_pb2.OpenHandoffRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no handoff side channel on a vLLM-backed instance")

    async def FetchPrefix(self, request: prefill_pb2.FetchPrefixRequest, context: grpc.aio.ServicerContext):
        return  # vLLM's cache is not read by peers; its blocks reach others through the kvstore
        yield  # noqa: B901 - an empty stream: "the cache holds none of them"

    # -- lifecycle ---------------------------------------------------------------------------------

    def _stop_choice(self, choice: ChoiceState) -> None:
        choice.finished = True
        if choice.task is not None and not choice.task.done():
            choice.task.cancel()  # vLLM's generate aborts its request when cancelled
        self._spawn(self.llm.abort(choice.vllm_id))

    def _drop(self, held: HeldRequest, reason: str, why: str) -> None:
        """End a request now: its choices stopped in vLLM, a reader told ``reason``."""
        if self.requests.get(held.request_id) is not held:
            return
        log.info("ending %s (%s): %s", held.request_id, reason, why)
        for choice in held.choices:
            if not choice.finished:
                self._stop_choice(choice)
        held.queue.put_nowait(ChoiceUpdate(0, (), (), reason, why))
        self._forget(held.request_id)

    def _forget(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.left.append(request_id)
            self.on_change()

    async def _unclaimed_after(self, held: HeldRequest) -> None:
        await asyncio.sleep(self.unclaimed_timeout_s)
        if not held.claimed:
            self._drop(held, ABORTED, f"nobody opened its stream within {self.unclaimed_timeout_s:g} s")

    def end_remaining(self) -> None:
        for held in list(self.requests.values()):
            self._drop(held, DRAINING, "decode draining")

    def _spawn(self, work) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def first_token_message(first: FirstTokens, index: int, prompt_tokens: int, cached_tokens: int) -> prefill_pb2.FirstToken:
    return prefill_pb2.FirstToken(token_id=first.token_id, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                  finished=first.finish_reason is not None, finish_reason=first.finish_reason or "",
                                  index=index, logprob=first.logprob)


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else ERROR


def _logprobs(step, ids: tuple[int, ...], top: int | None) -> list[common_pb2.TokenLogprob]:  # noqa: ANN001
    """vLLM's per-token dicts (sampled token + the ``top`` most likely, by rank) as Crescent's messages."""
    if top is None or not step.logprobs:
        return []
    out = []
    for token_id, entries in zip(ids, step.logprobs):
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= top)
        out.append(common_pb2.TokenLogprob(token_id=token_id, logprob=entries[token_id].logprob,
                                           top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for _, t, lp in ranked]))
    return out
