"""From a reply's text to what the client sees: reasoning, content and tool calls.

``parse_output`` wraps ``generation.generate_text``: its text deltas go through the reasoning
parser (``<think>``…``</think>`` → ``ReasoningDelta``) and then, when the request offered tools,
through the tool-call parser (→ ``ToolCallDelta``); the rest stays ``TextDelta`` content. A
reply that ends normally after at least one complete tool call finishes with ``"tool_calls"``;
with ``parallel_tool_calls`` false only the first call is kept (later ones are dropped).
A Kimi K3 reply (XTML) goes through ``xtml_output`` instead, which splits all three at once.
What a model emits is its ``output_format.OutputFormat``; the plain one (no reasoning, no tools)
passes text through untouched. ``TokenLogprobs`` pass through as they arrive (before the text of
their tokens, which a parser may hold back a while).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal, TypeAlias

from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta
from crescent.services.gateway.parsing.json_tool_calls import JsonToolCallParser, JsonToolCallTags
from crescent.services.gateway.logprobs import TokenLogprobs
from crescent.services.gateway.parsing.output_format import OutputFormat
from crescent.services.gateway.owning import Owning
from crescent.services.gateway.parsing.reasoning import Piece, ReasoningParser
from crescent.services.gateway.parsing.tool_calls import (
    ContentText,
    ToolCallArguments,
    ToolCallHeader,
    ToolCallMarkers,
    ToolCallParser,
)
from crescent.services.gateway.parsing.xtml_output import ReasoningText, XtmlEvent, XtmlReplyParser


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


OutputEvent: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta | TokenLogprobs | Finished
ReplyFinishReason: TypeAlias = Literal["stop", "length", "tool_calls"]


def _tool_call_parser(markup: ToolCallMarkers | JsonToolCallTags | None) -> ToolCallParser | JsonToolCallParser | None:
    if markup is None:
        return None
    return JsonToolCallParser(markup) if isinstance(markup, JsonToolCallTags) else ToolCallParser(markup)


class AssistantOutputParser:
    """Synchronous core of ``parse_output``: text in, client-facing events out."""

    def __init__(self, fmt: OutputFormat, *, parallel_tool_calls: bool = True) -> None:
        self._reasoning = ReasoningParser(fmt.reasoning) if fmt.reasoning is not None else None
        self._tools = _tool_call_parser(fmt.tool_calls)
        self._xtml = XtmlReplyParser(thinking=fmt.xtml_thinking, tools=fmt.xtml_tools) if fmt.xtml else None
        self._max_calls = None if parallel_tool_calls else 1

    @property
    def in_reasoning(self) -> bool:
        if self._xtml is not None:
            return self._xtml.in_reasoning
        return self._reasoning is not None and self._reasoning.in_reasoning

    @property
    def completed_tool_calls(self) -> int:
        tools = self._xtml if self._xtml is not None else self._tools
        done = tools.completed_calls if tools is not None else 0
        return done if self._max_calls is None else min(done, self._max_calls)

    def push(self, text: str) -> list[OutputEvent]:
        if self._xtml is not None:
            return self._xtml_events(self._xtml.push(text))
        if self._reasoning is None:
            return self._content(text)
        return self._split(self._reasoning.push(text))

    def finish(self) -> list[OutputEvent]:
        if self._xtml is not None:
            return self._xtml_events(self._xtml.finish())
        out = self._split(self._reasoning.finish()) if self._reasoning is not None else []
        if self._tools is not None:
            out += self._calls(self._tools.finish())
        return out

    def _xtml_events(self, events: list[XtmlEvent]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            out += [ReasoningDelta(event.text)] if isinstance(event, ReasoningText) else self._calls([event])
        return out

    def _split(self, pieces: list[Piece]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for piece in pieces:
            out += [ReasoningDelta(piece.text)] if piece.channel == "reasoning" else self._content(piece.text)
        return out

    def _content(self, text: str) -> list[OutputEvent]:
        if self._tools is None:
            return [TextDelta(text)] if text else []
        return self._calls(self._tools.push(text))

    def _calls(self, events: list[ContentText | ToolCallHeader | ToolCallArguments]) -> list[OutputEvent]:
        """Client events; calls past the first are dropped when only one is allowed."""
        limit = self._max_calls
        return [_event(e) for e in events if limit is None or isinstance(e, ContentText) or e.index < limit]


def _event(event: ContentText | ToolCallHeader | ToolCallArguments) -> OutputEvent:
    if isinstance(event, ContentText):
        return TextDelta(event.text)
    if isinstance(event, ToolCallHeader):
        return ToolCallDelta(event.index, event.call_id, event.name, "")
    return ToolCallDelta(event.index, None, None, event.text)


def final_finish_reason(reason: ReplyFinishReason, completed_tool_calls: int) -> ReplyFinishReason:
    return "tool_calls" if reason == "stop" and completed_tool_calls else reason


def parse_output(
    events: AsyncGenerator[GenerationEvent, None], fmt: OutputFormat, *, parallel_tool_calls: bool = True,
    on_reasoning: Callable[[], None] | None = None,
) -> AsyncGenerator[OutputEvent, None]:
    """Re-emit ``events`` split into reasoning, content and tool calls; closing this closes
    ``events``, read or not (``owning``). ``on_reasoning`` is called after each text delta that
    was (or ended) reasoning: the tokens generated so far are reasoning tokens."""
    return Owning(_parse_output(events, fmt, parallel_tool_calls, on_reasoning), events.aclose)


async def _parse_output(events: AsyncGenerator[GenerationEvent, None], fmt: OutputFormat,
                        parallel_tool_calls: bool,
                        on_reasoning: Callable[[], None] | None) -> AsyncGenerator[OutputEvent, None]:
    parser = AssistantOutputParser(fmt, parallel_tool_calls=parallel_tool_calls)
    async with aclosing(events):
        async for event in events:
            if isinstance(event, TextDelta):
                was_reasoning = parser.in_reasoning
                pushed = parser.push(event.text)
                if on_reasoning is not None and (was_reasoning or parser.in_reasoning):
                    on_reasoning()  # this delta's tokens were reasoning, or ended it
                for out in pushed:
                    yield out
                continue
            if isinstance(event, TokenLogprobs):  # passed on as they come: the stream attaches them
                yield event
                continue
            for out in parser.finish():
                yield out
            reason = final_finish_reason(event.finish_reason, parser.completed_tool_calls)
            yield Finished(reason, event.usage)
            return
