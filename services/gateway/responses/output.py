"""What ``/v1/responses`` answers: output items, usage, the response object.

``OutputBuilder`` turns the reply's events (``assistant_output``: reasoning, text, tool-call
deltas, in the order the model wrote them) into output items, and says which stream events
build them (``responses_stream`` numbers and sends those). A non-streamed response runs the
same builder and keeps only the items, so both forms of a reply hold the same output. An item
is open while its text arrives; the next kind of text (or the next tool call) closes it.
Shapes follow the ``openai`` SDK's ``openai.types.responses`` models.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from crescent.services.gateway.accounting import UsageCounts
from crescent.services.gateway.parsing.assistant_output import OutputEvent, ReasoningDelta, ToolCallDelta
from crescent.services.gateway.generation import TextDelta
from crescent.services.gateway.responses.api import ResponseRequest

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
StreamEvent = dict[str, Any]  # {"type": ..., fields}; the stream adds sequence_number


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOutput(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningTextOutput(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """The model's reasoning, whole (``content``); no summary is written (``summary`` stays empty)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextOutput]
    status: ItemStatus


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # not tracked


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens generated up to the end of the reasoning (included in output_tokens)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


def response_usage(usage: UsageCounts) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens, total_tokens=usage.prompt_tokens + usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseErrorInfo(BaseModel):
    code: Literal["server_error", "rate_limit_exceeded"]  # the values the SDK knows
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object; the request's settings are echoed back as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    completed_at: int | None = None
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class ResponseDraft:
    """What every form of one response repeats: its id, the request's settings, its conversation."""

    body: ResponseRequest
    model: str  # the served name
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    # What the generation samples with (the model card may fill in or fix them); None: the request's.
    temperature: float | None = None
    top_p: float | None = None

    def response(self, status: ResponseStatus, output: list[OutputItem], usage: UsageCounts | None = None,
                 error: ResponseErrorInfo | None = None) -> ResponseObject:
        b = self.body
        fmt = b.text_format().model_dump(exclude_none=True, by_alias=True)
        choice = b.tool_choice if b.tool_choice is not None else "auto"
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=error, incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=b.parallel_tool_calls is not False, previous_response_id=b.previous_response_id,
            reasoning=b.reasoning.model_dump(include={"effort", "summary"}) if b.reasoning else
            {"effort": None, "summary": None},
            store=b.store, temperature=b.temperature if self.temperature is None else self.temperature,
            text={"format": fmt},
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            tools=[tool.model_dump() for tool in b.tools or ()], top_p=b.top_p if self.top_p is None else self.top_p,
            usage=response_usage(usage) if usage is not None else None, user=b.user, metadata=b.metadata or {},
        )


class _Open:
    """The item whose text is arriving."""

    def __init__(self, kind: Literal["message", "reasoning", "function_call"], index: int, *, call_id: str = "",
                 name: str = "", tool_index: int = -1) -> None:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self.kind, self.index, self.id = kind, index, new_id(prefix)
        self.call_id, self.name, self.tool_index = call_id, name, tool_index
        self.parts: list[str] = []

    def item(self, status: ItemStatus) -> OutputItem:
        text = "".join(self.parts)
        if self.kind == "message":
            return MessageOutput(id=self.id, status=status, content=[OutputText(text=text)] if status != "in_progress"
                                 else [])
        if self.kind == "reasoning":
            return ReasoningOutput(id=self.id, status=status, content=[ReasoningTextOutput(text=text)]
                                   if status != "in_progress" else [])
        return FunctionCallOutput(id=self.id, call_id=self.call_id, name=self.name,
                                  arguments=text if status != "in_progress" else "", status=status)

    def where(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, **fields}


class OutputBuilder:
    """Output items from a reply's events, and the stream events that build them."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: _Open | None = None

    def push(self, event: OutputEvent) -> list[StreamEvent]:
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, TextDelta):
            return self._text("message", event.text)
        if isinstance(event, ToolCallDelta):
            return self._call(event)
        return []  # nothing that shows in the output (logprobs, never asked for here)

    def finish(self, cut: bool) -> list[StreamEvent]:
        """Close the open item (incomplete when the reply was ``cut``); a reply with no answer gets an empty one."""
        events = self._close("incomplete" if cut else "completed")
        if not any(isinstance(item, MessageOutput | FunctionCallOutput) for item in self.items):
            events += self._start(_Open("message", len(self.items)))
            events += self._close("incomplete" if cut else "completed")
        return events

    def items_so_far(self) -> list[OutputItem]:
        """Every item, the open one as it stands (for a response that failed)."""
        if self._open is None:
            return list(self.items)
        return [*self.items, self._open.item("incomplete")]

    def _text(self, kind: Literal["message", "reasoning"], text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not text:
            return events
        if self._open is None or self._open.kind != kind:
            events += self._close("completed")
            events += self._start(_Open(kind, len(self.items)))
        item = self._open
        assert item is not None
        item.parts.append(text)
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append({"type": delta, **item.where(content_index=0, delta=text, **extra)})
        return events

    def _call(self, delta: ToolCallDelta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.call_id is not None:  # a new call: its id and name come first
            events += self._close("completed")
            events += self._start(_Open("function_call", len(self.items), call_id=delta.call_id,
                                        name=delta.name or "", tool_index=delta.index))
        item = self._open
        if item is None or item.kind != "function_call" or item.tool_index != delta.index:
            raise AssertionError("the tool-call parser sends a call's arguments right after its header")
        if delta.arguments:
            item.parts.append(delta.arguments)
            events.append({"type": "response.function_call_arguments.delta", **item.where(delta=delta.arguments)})
        return events

    def _start(self, item: _Open) -> list[StreamEvent]:
        self._open = item
        events: list[StreamEvent] = [{"type": "response.output_item.added", "output_index": item.index,
                                      "item": item.item("in_progress").model_dump()}]
        if item.kind == "message":
            part = OutputText(text="").model_dump()
            events.append({"type": "response.content_part.added", **item.where(content_index=0, part=part)})
        elif item.kind == "reasoning":
            part = ReasoningTextOutput(text="").model_dump()
            events.append({"type": "response.content_part.added", **item.where(content_index=0, part=part)})
        return events

    def _close(self, status: ItemStatus) -> list[StreamEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.parts)
        events: list[StreamEvent] = []
        if item.kind == "message":
            events.append({"type": "response.output_text.done", **item.where(content_index=0, text=text, logprobs=[])})
            part = OutputText(text=text).model_dump()
            events.append({"type": "response.content_part.done", **item.where(content_index=0, part=part)})
        elif item.kind == "reasoning":
            events.append({"type": "response.reasoning_text.done", **item.where(content_index=0, text=text)})
            part = ReasoningTextOutput(text=text).model_dump()
            events.append({"type": "response.content_part.done", **item.where(content_index=0, part=part)})
        else:
            events.append({"type": "response.function_call_arguments.done", **item.where(arguments=text)})
        done = item.item(status)
        self.items.append(done)
        events.append({"type": "response.output_item.done", "output_index": item.index, "item": done.model_dump()})
        return events
