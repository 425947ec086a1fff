"""Server-sent events for streamed chat completions.

The stream is ``data: {chunk}\\n\\n`` lines: a first chunk with ``delta.role``, content (or
``reasoning_content``, or ``tool_calls``) chunks,
a chunk with ``finish_reason``, a usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``. An error after the stream started is sent as ``data: {"error": ...}`` (the
``openai`` client raises it). However the response ends (finished, client gone, server
stopping), ``SseResponse`` closes the generation, which cancels its backend calls.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from crescent.services.gateway.accounting import RequestRecord, UsageCounts
from crescent.services.gateway.api_models import (
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    FinishReason,
    FunctionDelta,
    PromptTokensDetails,
    ToolCallChunk,
    Usage,
)
from crescent.services.gateway.assistant_output import OutputEvent, ReasoningDelta, ToolCallDelta
from crescent.services.gateway.errors import ApiError, InternalError, RateLimitedError
from crescent.services.gateway.generation import Finished, TextDelta
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def usage_model(usage: UsageCounts) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def status_of(error: ApiError) -> str:
    """The requests-counter label for an error."""
    if isinstance(error, RateLimitedError):
        return "rejected"  # told to retry later: the scheduler's early rejection, or no capacity
    return "client_error" if 400 <= error.status < 500 else "error"


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What every chunk of one response repeats."""

    request_id: str
    created: int
    model: str
    include_usage: bool


class ChatStream:
    """One streamed response: its pending generation, and the record that accounts for it."""

    def __init__(
        self,
        header: ChunkHeader,
        first: OutputEvent,
        events: AsyncGenerator[OutputEvent, None],
        record: RequestRecord,
    ) -> None:
        self._header = header
        self._first = first
        self._events = events
        self._record = record

    def _chunk(self, delta: Delta, finish_reason: FinishReason | None = None, usage: Usage | None = None,
               choices: bool = True) -> str:
        h = self._header
        chunk = ChatCompletionChunk(
            id=h.request_id, created=h.created, model=h.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)] if choices else [],
            usage=usage,
        )
        body = chunk.model_dump(exclude=None if h.include_usage else {"usage"})
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        yield self._chunk(Delta(role="assistant", content=""))
        event: OutputEvent = self._first
        while True:
            if isinstance(event, TextDelta):
                yield self._chunk(Delta(content=event.text))
            elif isinstance(event, ReasoningDelta):
                yield self._chunk(Delta(reasoning_content=event.text))
            elif isinstance(event, ToolCallDelta):
                yield self._chunk(Delta(tool_calls=[_tool_call_chunk(event)]))
            elif isinstance(event, Finished):
                yield self._chunk(Delta(), finish_reason=event.finish_reason)
                if self._header.include_usage:
                    yield self._chunk(Delta(), usage=usage_model(event.usage), choices=False)
                yield DONE
                self._record.finish("ok")
                return
            try:
                event = await anext(self._events)
            except ApiError as exc:
                yield self._error(exc)
                return
            except StopAsyncIteration:
                yield self._error(InternalError("the generation ended without a finish"))
                return
            except Exception:
                log.exception("stream failed")
                yield self._error(InternalError("internal error"))
                return

    def _error(self, error: ApiError) -> str:
        log.warning("stream failed after it started: %s", error.message)
        self._record.finish(status_of(error))
        return f"data: {json.dumps(error.body())}\n\n"

    async def close(self) -> None:
        """Cancel whatever is still running; a stream that did not finish counts as cancelled."""
        await self._events.aclose()
        self._record.finish("cancelled")


def _tool_call_chunk(event: ToolCallDelta) -> ToolCallChunk:
    if event.call_id is None:
        return ToolCallChunk(index=event.index, function=FunctionDelta(arguments=event.arguments))
    return ToolCallChunk(index=event.index, id=event.call_id, type="function",
                         function=FunctionDelta(name=event.name, arguments=event.arguments))


class SseResponse(StreamingResponse):
    """A streaming response that always closes its ``ChatStream``, even if never iterated."""

    def __init__(self, stream: ChatStream) -> None:
        super().__init__(
            stream.sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.close()
