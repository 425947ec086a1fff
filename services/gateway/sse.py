"""Server-sent events for streamed chat completions.

The stream is ``data: {chunk}\\n\\n`` lines: a first chunk with ``delta.role``, content (or
``reasoning_content``, or ``tool_calls``) chunks,
a chunk with ``finish_reason``, a usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``. With ``logprobs``, a chunk carries the entries of the tokens whose text it
holds (entries whose text a parser still holds back ride with a later chunk, at the latest the
one with ``finish_reason``). A stream that cannot finish (the backend failed past what migration could
save, or the gateway's drain grace ran out) ends with one chunk carrying both
``finish_reason: "error"`` and an ``"error"`` object (the ``openai`` client raises it), then
``data: [DONE]``: a client always sees a finish reason and ``[DONE]``. However the response ends
(finished, client gone, server stopping), ``SseResponse`` closes the generation, which cancels
its backend calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from crescent.services.gateway.accounting import RequestRecord, UsageCounts
from crescent.services.gateway.api_models import (
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    FunctionDelta,
    StreamFinishReason,
    PromptTokensDetails,
    ToolCallChunk,
    Usage,
)
from crescent.services.gateway.assistant_output import OutputEvent, ReasoningDelta, ToolCallDelta
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ApiError, InternalError, RateLimitedError
from crescent.services.gateway.generation import Finished, TextDelta
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, chat_logprobs
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
        drain: Drain,
    ) -> None:
        self._header = header
        self._first = first
        self._events = events
        self._record = record
        self._drain = drain
        self._next: asyncio.Task[OutputEvent] | None = None  # reading the generation's next event
        self._logprobs: list[ReportedToken] = []  # entries not sent yet: they go with the next chunk

    def _chunk(self, delta: Delta, finish_reason: StreamFinishReason | None = None, usage: Usage | None = None,
               choices: bool = True, error: ApiError | None = None) -> str:
        h = self._header
        logprobs = None
        if choices and self._logprobs:  # entries waiting for a chunk: this one carries them
            logprobs, self._logprobs = chat_logprobs(self._logprobs), []
        chunk = ChatCompletionChunk(
            id=h.request_id, created=h.created, model=h.model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)] if choices else [],
            usage=usage,
        )
        body = chunk.model_dump(exclude=None if h.include_usage else {"usage"})
        if error is not None:
            body.update(error.body())
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
            elif isinstance(event, TokenLogprobs):
                self._logprobs.extend(event.entries)  # before their text: the text's chunk carries them
            elif isinstance(event, Finished):
                yield self._chunk(Delta(), finish_reason=event.finish_reason)
                if self._header.include_usage:
                    yield self._chunk(Delta(), usage=usage_model(event.usage), choices=False)
                yield DONE
                self._record.finish("ok")
                return
            try:
                self._next = asyncio.ensure_future(anext(self._events))
                event = await self._drain.race(self._next)
            except ApiError as exc:
                error: ApiError = exc
            except StopAsyncIteration:
                error = InternalError("the generation ended without a finish")
            except Exception:
                log.exception("stream failed")
                error = InternalError("internal error")
            else:
                continue
            yield self._error(error)
            yield DONE
            return

    def _error(self, error: ApiError) -> str:
        log.warning("stream failed after it started: %s", error.message)
        self._record.finish(status_of(error))
        self._logprobs = []  # their text never came
        return self._chunk(Delta(), finish_reason="error", error=error)

    async def close(self) -> None:
        """Cancel whatever is still running; a stream that did not finish counts as cancelled."""
        if self._next is not None and not self._next.done():
            # The response was cancelled (client gone) before the read could be awaited to its end.
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
        await self._events.aclose()
        self._record.finish("cancelled")


def _tool_call_chunk(event: ToolCallDelta) -> ToolCallChunk:
    if event.call_id is None:
        return ToolCallChunk(index=event.index, function=FunctionDelta(arguments=event.arguments))
    return ToolCallChunk(index=event.index, id=event.call_id, type="function",
                         function=FunctionDelta(name=event.name, arguments=event.arguments))


class EventStream(Protocol):
    """What ``SseResponse`` sends: a ``ChatStream``, or ``completions_stream.CompletionStream``."""

    def sse(self) -> AsyncIterator[str]: ...

    async def close(self) -> None: ...


class SseResponse(StreamingResponse):
    """A streaming response that always closes its stream (``EventStream``), even if never iterated."""

    def __init__(self, stream: EventStream) -> None:
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
