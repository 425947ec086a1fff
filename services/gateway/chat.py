"""``POST /v1/chat/completions``: validate, build the prompt, generate, answer or stream.

Errors that happen before the first token (bad request, rejection, backend down) are plain
HTTP errors even for streaming requests: the stream starts only once there is something to
send. A non-streaming request whose client goes away is cancelled like a stream would be.
With ``n > 1`` the backend gives each choice's events (``choices``); the response waits for
choice 0's first token, and a client that goes away cancels every choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

from crescent.services.common.metrics import GatewayMetrics
from crescent.services.contract.finish import stop_token_ids
from crescent.services.gateway.accounting import RequestRecord, response_usage
from crescent.services.gateway.api_models import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    FunctionCallOut,
    ToolCallOut,
)
from crescent.services.gateway.parsing.assistant_output import OutputEvent, ReasoningDelta, ToolCallDelta, parse_output
from crescent.services.gateway.auth import Principal, principal_of
from crescent.services.gateway.backend import Backend, BackendEvent, GenerationRequest, RequestId, Sampling
from crescent.services.gateway.choice_stream import ChoiceStream
from crescent.services.gateway.choices import collect_choices, leaders_first, resumed
from crescent.services.gateway.client_gone import answered, unless_disconnected
from crescent.services.gateway.config import GatewaySettings
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ModelNotFoundError, UnsupportedParameterError
from crescent.services.gateway.generation import Finished, TextDelta, generate_text
from crescent.services.gateway.limits.http import admit
from crescent.services.gateway.ledger import UsageLedger
from crescent.services.gateway.logit_bias import token_biases
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, chat_logprobs
from crescent.services.gateway.prompt import ServedModel, build_prompt
from crescent.services.gateway.sse import ChatChunks, ChunkHeader, SseResponse, usage_model
from crescent.services.gateway.parsing.structured_output import constraint_of, ensure_enforceable
from crescent.services.tenancy import cache_salt
from fastapi import Request
from fastapi.responses import JSONResponse, Response

log = logging.getLogger(__name__)

def new_request_id() -> RequestId:
    return RequestId(f"chatcmpl-{uuid.uuid4().hex}")


class ChatCompletions:
    def __init__(
        self, settings: GatewaySettings, backend: Backend, model: ServedModel, metrics: GatewayMetrics, drain: Drain,
        ledger: UsageLedger | None = None,
    ) -> None:
        self._settings = settings
        self._ledger = ledger
        self._drain = drain
        self._backend = backend
        self._model = model
        self._metrics = metrics
        self.served_name = settings.served_model_name or model.model_id

    async def generation_request(self, body: ChatCompletionRequest, request_id: RequestId,
                                 principal: Principal) -> GenerationRequest:
        """The backend request for ``body``: checks, prompt, constraint, sampling (``responses`` reuses it)."""
        return await self._generation_request(self.checked(body), request_id, principal)

    def checked(self, body: ChatCompletionRequest) -> ChatCompletionRequest:
        """``body`` under the model card (defaults filled in), or the 400 for what cannot be served."""
        if body.model != self.served_name:
            raise ModelNotFoundError(
                f"the model {body.model!r} does not exist; this gateway serves {self.served_name!r}", param="model"
            )
        body = self._model.policy.apply(body)  # the model card: refuse what it fixes, fill in its defaults
        unsupported = body.unsupported_values()
        if unsupported:
            param, why = unsupported[0]
            raise UnsupportedParameterError(f"unsupported value for {param}: {why}", param=param)
        return body

    async def _generation_request(self, body: ChatCompletionRequest, request_id: RequestId,
                                  principal: Principal) -> GenerationRequest:
        # Templating and tokenizing a long prompt takes milliseconds of CPU: keep it off the event loop.
        prompt = await asyncio.to_thread(build_prompt, body, self._model, self._settings.default_max_tokens)
        salt = cache_salt(principal.salt, body.cache_salt)  # the tenant's, narrowed by the client's
        constraint = constraint_of(body, self._model.output_format, self._settings.max_constraint_bytes)
        # The one stop rule: engines apply the same function with their own EOS ids.
        stops = stop_token_ids(body.stop_token_ids or (), self._model.tokenizer.eos_token_ids, body.ignore_eos)
        return GenerationRequest(
            request_id=request_id,
            model_id=self._model.model_id,
            prompt_token_ids=prompt.token_ids,
            cache_salt=salt,
            sampling=Sampling(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                seed=body.seed,
                max_tokens=prompt.max_tokens,
                stop_token_ids=tuple(sorted(stops)),
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=token_biases(body.logit_bias, self._model.tokenizer.vocab_size),
                min_tokens=body.min_tokens,
                constraint=constraint,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            ),
        )

    def reply_events(self, body: ChatCompletionRequest, generation: GenerationRequest,
                     events: AsyncGenerator[BackendEvent, None], record: RequestRecord,
                     index: int = 0) -> AsyncGenerator[OutputEvent, None]:
        """One choice's reply from its backend ``events``, as the client sees it: text cut at stop
        strings, reasoning, tool calls (``responses`` uses it too)."""
        fmt = self._model.output_format if body.offers_tools() else self._model.output_format.without_tools()
        fmt = fmt.for_thinking(body.thinking is None or body.thinking.type == "enabled")
        text = generate_text(events, self._model.tokenizer, generation, body.stop_strings(), record, index)
        return parse_output(text, fmt, parallel_tool_calls=body.parallel_tool_calls is not False,
                            on_reasoning=partial(record.mark_reasoning, index))

    def new_record(self, request_id: str, request: Request) -> RequestRecord:
        """The record of a request whose client sees ``request_id``: priced into the ledger when there is one."""
        account = None if self._ledger is None else self._ledger.account(request_id, principal_of(request),
                                                                          self.served_name)
        return RequestRecord(self._metrics, account=account)

    async def handle(self, body: ChatCompletionRequest, request: Request) -> Response:
        request_id = new_request_id()
        # Log records keep the HTTP request id (X-Request-Id) the client sees; link the two once.
        log.info("completion %s", request_id)
        record = self.new_record(request_id, request)
        return await answered(self._respond(body, request, request_id, record), record, before="the first token")

    async def _respond(self, body: ChatCompletionRequest, request: Request, request_id: RequestId,
                       record: RequestRecord) -> Response:
        body = self.checked(body)  # the card first: a locked n is refused before n is read
        n = body.n
        generation = await self._generation_request(body, request_id, principal_of(request))
        await admit(request, self.served_name, [generation], n, [record])  # the key's and tenant's limits
        await ensure_enforceable(body, generation.sampling.constraint)  # compiled once admitted, off the loop
        events = [self.reply_events(body, generation, choice, record, i)
                  for i, choice in enumerate(self._backend.generate_choices(generation, n))]
        header = ChunkHeader(
            request_id=request_id,
            created=int(time.time()),
            model=self.served_name,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )
        if not body.stream:
            collected = await unless_disconnected(request, self._drain.race(
                collect_choices(events, [0], partial(_collect, logprobs=body.logprobs))))
            record.finish("ok")
            await record.committed()  # a client that has its answer is in the usage ledger
            completion = ChatCompletion(
                id=header.request_id, created=header.created, model=header.model,
                choices=[choice.model_copy(update={"index": i}) for i, (choice, _) in enumerate(collected)],
                usage=usage_model(response_usage([finished.usage for _, finished in collected], n)),
            )
            return JSONResponse(completion.model_dump())
        firsts = await unless_disconnected(request, self._drain.race(leaders_first(events, [0])))
        return SseResponse(ChoiceStream(ChatChunks(header), events, firsts, [record] * n,
                                        partial(response_usage, n=n), self._drain))


async def _collect(events: AsyncGenerator[OutputEvent, None], first: OutputEvent | None, *,
                   logprobs: bool = False) -> tuple[Choice, Finished]:
    """One choice's whole reply (its ``index`` left at 0), after ``first`` (already read from ``events``)."""
    parts: list[str] = []
    entries: list[ReportedToken] = []
    reasoning: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}  # index -> id, name, argument fragments
    async with aclosing(resumed(first, events)) as reply:
        async for event in reply:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, TokenLogprobs):
                entries.extend(event.entries)
            elif isinstance(event, ToolCallDelta):
                if event.call_id is not None:
                    calls[event.index] = (event.call_id, event.name or "", [])
                calls[event.index][2].append(event.arguments)
            elif isinstance(event, Finished):
                tool_calls = [
                    ToolCallOut(id=call_id, function=FunctionCallOut(name=name, arguments="".join(args)))
                    for call_id, name, args in (calls[i] for i in sorted(calls))
                ]
                message = AssistantMessage(
                    content="".join(parts) if parts or not tool_calls else None,
                    reasoning_content="".join(reasoning) if reasoning else None,
                    tool_calls=tool_calls or None,
                )
                choice = Choice(message=message, finish_reason=event.finish_reason,
                                logprobs=chat_logprobs(entries) if logprobs else None)
                return choice, event
    raise AssertionError("generate_text always ends with Finished or an error")
