"""Server-sent events for streamed responses (``/v1/responses`` with ``stream: true``).

Each event is an ``event: <type>`` line and a ``data: {json}`` line carrying the same ``type``
and a ``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``, the
events that build each output item (``responses_output.OutputBuilder``), then
``response.completed`` (or ``response.incomplete`` when cut by ``max_output_tokens``) carrying
the whole response. There is no ``[DONE]`` line: the final event ends the stream.

A stream that cannot finish (the backend failed past what migration could save, the drain
grace ran out) ends with an ``error`` event (the gateway's code and message) and then
``response.failed``, whose response holds the output so far: never a silent truncation. A
stored response is stored before its final event is sent, so a client that has seen it can
retrieve it. However the response ends, ``sse.SseResponse`` closes the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from crescent.services.gateway.accounting import RequestRecord
from crescent.services.gateway.parsing.assistant_output import OutputEvent
from crescent.services.gateway.choice_stream import result_or_error, status_of
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ApiError, InternalError, RateLimitedError
from crescent.services.gateway.generation import Finished
from crescent.services.gateway.responses.output import (
    OutputBuilder,
    ResponseDraft,
    ResponseErrorInfo,
    ResponseObject,
    StreamEvent,
)

log = logging.getLogger(__name__)

OnDone = Callable[[ResponseObject, OutputBuilder], Awaitable[None]]


def failure_info(error: ApiError) -> ResponseErrorInfo:
    """A failed response's ``error``: the SDK knows two codes that fit a failure here."""
    code = "rate_limit_exceeded" if isinstance(error, RateLimitedError) and error.status == 429 else "server_error"
    return ResponseErrorInfo(code=code, message=error.message)


class ResponseStream:
    """One streamed response: its pending generation, the record that accounts for it, what to do at the end."""

    def __init__(self, draft: ResponseDraft, first: OutputEvent, events: AsyncGenerator[OutputEvent, None],
                 record: RequestRecord, drain: Drain, on_done: OnDone) -> None:
        self._draft = draft
        self._first = first
        self._events = events
        self._record = record
        self._drain = drain
        self._on_done = on_done
        self._builder = OutputBuilder()
        self._sequence = 0
        self._next: asyncio.Task[OutputEvent] | None = None

    def _sse(self, event: StreamEvent) -> str:
        body = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self._sse({"type": kind, "response": response.model_dump()})

    async def sse(self) -> AsyncIterator[str]:
        created = self._draft.response("in_progress", [])
        yield self._lifecycle("response.created", created)
        yield self._lifecycle("response.in_progress", created)
        event: OutputEvent = self._first
        while True:
            if isinstance(event, Finished):
                cut = event.finish_reason == "length"
                for built in self._builder.finish(cut):
                    yield self._sse(built)
                response = self._draft.response("incomplete" if cut else "completed", self._builder.items, event.usage)
                try:
                    await self._on_done(response, self._builder)
                except Exception:
                    log.exception("storing the response failed")
                    for line in self._failed(InternalError("the response could not be stored")):
                        yield line
                    return
                self._record.finish("ok")
                await self._record.committed()  # a client that has the final event is in the usage ledger
                yield self._lifecycle("response.incomplete" if cut else "response.completed", response)
                return
            for built in self._builder.push(event):
                yield self._sse(built)
            self._next = asyncio.ensure_future(anext(self._events))
            event = await result_or_error(self._drain.race(self._next))
            if not isinstance(event, ApiError):
                continue
            for line in self._failed(event):
                yield line
            return

    def _failed(self, error: ApiError) -> list[str]:
        log.warning("stream failed after it started: %s", error.message)
        self._record.finish(status_of(error))  # type: ignore[arg-type]  # a RequestStatus
        response = self._draft.response("failed", self._builder.items_so_far(), self._record.usage,
                                        error=failure_info(error))
        return [
            self._sse({"type": "error", "code": error.code, "message": error.message, "param": error.param}),
            self._lifecycle("response.failed", response),
        ]

    async def close(self) -> None:
        """Cancel whatever is still running; a stream that did not finish counts as cancelled."""
        if self._next is not None and not self._next.done():
            self._next.cancel()  # the response was cancelled (client gone) while a read was in flight
            await asyncio.gather(self._next, return_exceptions=True)
        await self._events.aclose()
        self._record.finish("cancelled")
