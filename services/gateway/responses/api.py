"""The HTTP contract of ``POST /v1/responses`` (OpenAI's Responses API): the request.

The same conventions as chat (``api_models``): strict types, unknown fields refused by name
(``extra="forbid"``), an explicit ``null`` means absent. The request is translated into a chat
request (``responses_input``) and from there takes chat's path, so what chat refuses (a
``reasoning.effort``, a forced ``tool_choice``, an unenforceable schema) is refused here too,
under this API's parameter name.

``input`` items are what a client sends and what it sends back: the output items of an earlier
response (with their ``id`` and ``status``) are valid input items, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from crescent.services.gateway.api_models import INT32_MAX, RequestModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class InputText(RequestModel):
    """Text of a message: ``input_text`` from the client, ``output_text`` from an earlier reply."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back as it came
    logprobs: list[Any] | None = None


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON, as the model wrote it
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(RequestModel):
    """The client's result of a call, matched to it by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(RequestModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestModel):
    """The model's reasoning in an earlier turn: it goes back into the next assistant turn."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # never produced here; a client's from elsewhere means nothing
    status: ItemStatus | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type") or "message"  # a message may leave its type out
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="an item's type must be message, function_call, function_call_output "
                                       "or reasoning"),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def item_error(exc: ValidationError) -> str:
    """The deepest error of a list of items, as ``input[i].field: why`` (union member tags left out)."""
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    loc = list(error["loc"])
    path = f"input[{loc[0]}]" if loc and isinstance(loc[0], int) else "input"
    for part in loc[2:]:  # loc[1] is the item's type tag
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part:
            path += f".{part}"
    return f"{path}: {error['msg']}"


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ReasoningConfig(RequestModel):
    effort: str | None = None  # whatever chat's reasoning_effort accepts
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; reasoning comes whole, not summarised
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class ResponseRequest(RequestModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    # Accepted and ignored: they mean nothing on this platform (docs/responses.md says why).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted only at the value that means "off"; anything else is refused by name.
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_form(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        # One message naming the item and field, instead of one line per union member that did not match.
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("input must be a string or a list of items")
        try:
            return INPUT_ITEMS.validate_python(value)
        except ValidationError as exc:
            raise ValueError(item_error(exc)) from None

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def text_format(self) -> TextFormat:
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None else TextFormat(type="text")

    def unsupported_values(self) -> list[tuple[str, str]]:
        """(param, why) for every accepted parameter set to a value the platform cannot honour.

        Only what this API adds; the rest is chat's to refuse (``responses_input``)."""
        problems = []
        if self.truncation == "auto":
            problems.append(("truncation", "only 'disabled' is supported: the input is never cut to fit"))
        if self.background:
            problems.append(("background", "background responses are not supported"))
        if self.include:
            problems.append(("include", f"nothing can be included: {self.include[0]!r} is not supported"))
        if self.top_logprobs:
            problems.append(("top_logprobs", "logprobs are not supported"))
        if self.max_tool_calls is not None:
            problems.append(("max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls=false keeps one)"))
        fmt = self.text_format()
        if fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
            problems.append(("text.format", "a json_schema format needs its name and schema"))
        return problems
