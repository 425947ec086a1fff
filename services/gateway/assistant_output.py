"""From a reply's text to what the client sees: reasoning, content and tool calls.

``parse_output`` wraps ``generation.generate_text``: its text deltas go through the reasoning
parser (``<think>``…``</think>`` → ``ReasoningDelta``) and then, when the request offered tools,
through the tool-call parser (→ ``ToolCallDelta``); the rest stays ``TextDelta`` content. A
reply that ends normally after at least one complete tool call finishes with ``"tool_calls"``.
What a model emits is its ``output_format.OutputFormat``; the plain one (no reasoning, no tools)
passes text through untouched.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal, TypeAlias

from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta
from crescent.services.gateway.output_format import OutputFormat
from crescent.services.gateway.reasoning import Piece, ReasoningParser
from crescent.services.gateway.tool_calls import ContentText, ToolCallArguments, ToolCallHeader, ToolCallParser


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The first delta of a call carries its id and name; later ones only argument fragments."""

    index: int
    call_id: str | None
    name: str | None
    arguments: str


OutputEvent: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta | Finished
ReplyFinishReason: TypeAlias = Literal["stop", "length", "tool_calls"]


class AssistantOutputParser:
    """Synchronous core of ``parse_output``: text in, client-facing events out."""

    def __init__(self, fmt: OutputFormat) -> None:
        self._reasoning = ReasoningParser(fmt.reasoning) if fmt.reasoning is not None else None
        self._tools = ToolCallParser(fmt.tool_calls) if fmt.tool_calls is not None else None

    @property
    def completed_tool_calls(self) -> int:
        return self._tools.completed_calls if self._tools is not None else 0

    def push(self, text: str) -> list[OutputEvent]:
        if self._reasoning is None:
            return self._content(text)
        return self._split(self._reasoning.push(text))

    def finish(self) -> list[OutputEvent]:
        out = self._split(self._reasoning.finish()) if self._reasoning is not None else []
        if self._tools is not None:
            out += [_event(e) for e in self._tools.finish()]
        return out

    def _split(self, pieces: list[Piece]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for piece in pieces:
            out += [ReasoningDelta(piece.text)] if piece.channel == "reasoning" else self._content(piece.text)
        return out

    def _content(self, text: str) -> list[OutputEvent]:
        if self._tools is None:
            return [TextDelta(text)] if text else []
        return [_event(e) for e in self._tools.push(text)]


def _event(event: ContentText | ToolCallHeader | ToolCallArguments) -> OutputEvent:
    if isinstance(event, ContentText):
        return TextDelta(event.text)
    if isinstance(event, ToolCallHeader):
        return ToolCallDelta(event.index, event.call_id, event.name, "")
    return ToolCallDelta(event.index, None, None, event.text)


def final_finish_reason(reason: ReplyFinishReason, completed_tool_calls: int) -> ReplyFinishReason:
    return "tool_calls" if reason == "stop" and completed_tool_calls else reason


async def parse_output(
    events: AsyncGenerator[GenerationEvent, None], fmt: OutputFormat
) -> AsyncGenerator[OutputEvent, None]:
    """Re-emit ``events`` split into reasoning, content and tool calls; closing this closes ``events``."""
    parser = AssistantOutputParser(fmt)
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextDelta):
                for out in parser.push(event.text):
                    yield out
                continue
            for out in parser.finish():
                yield out
            reason = final_finish_reason(event.finish_reason, parser.completed_tool_calls)
            yield Finished(reason, event.usage)
            return
