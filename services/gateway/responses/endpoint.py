"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A response is a chat completion underneath (``responses_input``): the stored conversation of
``previous_response_id`` (if given), then this request's input, become a chat request, and
chat's ``generation_request`` builds what the backend gets. The reply's events become output
items (``responses_output``), answered whole or streamed (``responses_stream``). As in chat,
errors before the first token are plain HTTP errors even for streaming requests, and a client
that goes away cancels its generation. With ``store`` (the default) the response and its
conversation are kept in the ``response_store`` database once it has finished.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from crescent.services.common.metrics import GatewayMetrics
from crescent.services.gateway.accounting import RequestRecord
from crescent.services.gateway.parsing.assistant_output import OutputEvent
from crescent.services.gateway.auth import principal_of
from crescent.services.gateway.backend import Backend, RequestId
from crescent.services.gateway.chat import ChatCompletions
from crescent.services.gateway.client_gone import answered, unless_disconnected
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ApiError, NotFoundError, UnsupportedParameterError
from crescent.services.gateway.generation import Finished
from crescent.services.gateway.limits.http import admit
from crescent.services.gateway.prompt import ServedModel
from crescent.services.gateway.responses.store import ResponseStore
from crescent.services.gateway.responses.api import INPUT_ITEMS, ResponseRequest
from crescent.services.gateway.responses.input import Item, chat_request, responses_error
from crescent.services.gateway.responses.output import OutputBuilder, ResponseDraft, ResponseObject
from crescent.services.gateway.responses.stream import OnDone, ResponseStream
from crescent.services.gateway.sse import SseResponse
from crescent.services.gateway.parsing.structured_output import ensure_enforceable
from fastapi import Request
from fastapi.responses import JSONResponse, Response

log = logging.getLogger(__name__)


def _not_found(response_id: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"no stored response has the id {response_id!r}", param=param)


class Responses:
    def __init__(self, chat: ChatCompletions, backend: Backend, model: ServedModel, metrics: GatewayMetrics,
                 drain: Drain, store: ResponseStore) -> None:
        self._chat = chat
        self._backend = backend
        self._model = model
        self._metrics = metrics
        self._drain = drain
        self._store = store

    async def _history(self, tenant_id: str, previous_response_id: str | None) -> list[Item]:
        """The stored conversation this request continues (empty without ``previous_response_id``)."""
        if previous_response_id is None:
            return []
        stored = await self._store.get(tenant_id, previous_response_id)
        if stored is None:
            raise _not_found(previous_response_id, param="previous_response_id")
        return list(INPUT_ITEMS.validate_python(stored.conversation))

    async def create(self, body: ResponseRequest, request: Request) -> Response:
        draft = ResponseDraft(body, self._chat.served_name)
        log.info("response %s", draft.id)  # links the HTTP request id in log records to this one
        record = self._chat.new_record(draft.id, request)
        return await answered(self._respond(body, request, draft, record), record, before="the response was ready")

    async def _respond(self, body: ResponseRequest, request: Request, draft: ResponseDraft,
                       record: RequestRecord) -> Response:
        unsupported = body.unsupported_values()
        if unsupported:
            param, why = unsupported[0]
            raise UnsupportedParameterError(f"unsupported value for {param}: {why}", param=param)
        principal = principal_of(request)
        conversation = await self._history(principal.tenant_id, body.previous_response_id) + body.input_items()
        chat_body = chat_request(body, conversation)
        try:
            generation_request = await self._chat.generation_request(chat_body, RequestId(draft.id), principal)
        except ApiError as exc:
            raise responses_error(exc) from None
        await admit(request, self._chat.served_name, [generation_request], 1, [record])  # the key's and tenant's limits
        try:
            await ensure_enforceable(chat_body, generation_request.sampling.constraint)
        except ApiError as exc:
            raise responses_error(exc) from None
        sampling = generation_request.sampling
        draft = replace(draft, temperature=sampling.temperature, top_p=sampling.top_p)
        events = self._chat.reply_events(chat_body, generation_request, self._backend.generate(generation_request),
                                         record)
        stored = [item.model_dump(exclude_none=True, by_alias=True) for item in conversation]

        async def on_done(response: ResponseObject, builder: OutputBuilder) -> None:
            if body.store:
                await self._store.put(principal.tenant_id, response.model_dump(),
                                      stored + [i.model_dump() for i in builder.items])

        if not body.stream:
            response = await unless_disconnected(request, self._drain.race(self._collect(draft, events, on_done)))
            record.finish("ok")
            await record.committed()  # a client that has its answer is in the usage ledger
            return JSONResponse(response.model_dump())
        try:
            first = await unless_disconnected(request, self._drain.race(anext(events)))
        except BaseException:
            await events.aclose()
            raise
        return SseResponse(ResponseStream(draft, first, events, record, self._drain, on_done))

    async def _collect(self, draft: ResponseDraft, events: AsyncGenerator[OutputEvent, None],
                       on_done: OnDone) -> ResponseObject:
        builder = OutputBuilder()
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Finished):
                    cut = event.finish_reason == "length"
                    builder.finish(cut)
                    response = draft.response("incomplete" if cut else "completed", builder.items, event.usage)
                    await on_done(response, builder)
                    return response
                builder.push(event)
        raise AssertionError("generate_text always ends with Finished or an error")

    async def retrieve(self, tenant_id: str, response_id: str) -> JSONResponse:
        stored = await self._store.get(tenant_id, response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    async def delete(self, tenant_id: str, response_id: str) -> JSONResponse:
        if not await self._store.delete(tenant_id, response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
