"""Server-sent events for streamed chat completions.

Each choice's stream is ``data: {chunk}\\n\\n`` lines: a first chunk with ``delta.role``, content
(or ``reasoning_content``, or ``tool_calls``) chunks, a chunk with ``finish_reason``; with
``n > 1`` the choices' chunks interleave, each tagged with its ``index`` (``choice_stream`` runs
them). Then a usage chunk when ``stream_options.include_usage`` is set, and ``data: [DONE]``.
With ``logprobs``, a chunk carries the entries of the tokens whose text it holds (entries whose
text a parser still holds back ride with a later chunk of that choice, at the latest the one
with ``finish_reason``). A stream that cannot finish ends with one chunk giving every open
choice ``finish_reason: "error"`` and carrying an ``"error"`` object (the ``openai`` client
raises it), then ``data: [DONE]``. However the response ends (finished, client gone, server
stopping), ``SseResponse`` closes the stream, which cancels its backend calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from crescent.services.gateway.accounting import UsageCounts
from crescent.services.gateway.api_models import (
    ChatCompletionChunk,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    FunctionDelta,
    StreamFinishReason,
    PromptTokensDetails,
    ToolCallChunk,
    Usage,
)
from crescent.services.gateway.parsing.assistant_output import OutputEvent, ReasoningDelta, ToolCallDelta
from crescent.services.gateway.errors import ApiError
from crescent.services.gateway.generation import Finished, TextDelta
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, chat_logprobs
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def usage_model(usage: UsageCounts) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What every chunk of one response repeats."""

    request_id: str
    created: int
    model: str
    include_usage: bool


class ChatChunks:
    """Chat's ``choice_stream.ChunkFormat``: deltas per choice, logprobs held until their text's chunk."""

    def __init__(self, header: ChunkHeader) -> None:
        self._header = header
        self._logprobs: dict[int, list[ReportedToken]] = {}  # by choice: entries for its next chunk

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None, error: ApiError | None = None) -> str:
        h = self._header
        chunk = ChatCompletionChunk(id=h.request_id, created=h.created, model=h.model, choices=choices, usage=usage)
        body = chunk.model_dump(exclude=None if h.include_usage else {"usage"})
        if error is not None:
            body.update(error.body())
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _delta(self, index: int, delta: Delta, finish_reason: StreamFinishReason | None = None) -> str:
        entries = self._logprobs.pop(index, None)  # waiting for this choice's next chunk: this one carries them
        logprobs = chat_logprobs(entries) if entries else None
        return self._chunk([ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)])

    def opening(self, index: int) -> str:
        return self._delta(index, Delta(role="assistant", content=""))

    def event(self, index: int, event: OutputEvent) -> str | None:
        if isinstance(event, TextDelta):
            return self._delta(index, Delta(content=event.text))
        if isinstance(event, ReasoningDelta):
            return self._delta(index, Delta(reasoning_content=event.text))
        if isinstance(event, ToolCallDelta):
            return self._delta(index, Delta(tool_calls=[_tool_call_chunk(event)]))
        assert isinstance(event, TokenLogprobs), event
        self._logprobs.setdefault(index, []).extend(event.entries)  # before their text: its chunk carries them
        return None

    def finished(self, index: int, event: Finished) -> str:
        return self._delta(index, Delta(), finish_reason=event.finish_reason)

    def failed(self, open_choices: list[int], error: ApiError) -> str:
        for index in open_choices:
            self._logprobs.pop(index, None)  # their text never came
        return self._chunk([ChunkChoice(index=i, delta=Delta(), finish_reason="error") for i in open_choices],
                           error=error)

    def usage(self, usage: UsageCounts) -> str | None:
        return self._chunk([], usage=usage_model(usage)) if self._header.include_usage else None


def _tool_call_chunk(event: ToolCallDelta) -> ToolCallChunk:
    if event.call_id is None:
        return ToolCallChunk(index=event.index, function=FunctionDelta(arguments=event.arguments))
    return ToolCallChunk(index=event.index, id=event.call_id, type="function",
                         function=FunctionDelta(name=event.name, arguments=event.arguments))


class EventStream(Protocol):
    """What ``SseResponse`` sends: a ``choice_stream.ChoiceStream`` (chat, text completions), or responses'."""

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
