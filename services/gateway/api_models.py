"""The OpenAI-compatible HTTP contract of ``/v1/chat/completions`` and ``/v1/models``.

Requests are strict: a field of the wrong type is a 400, not a silent coercion, and a parameter
the platform does not implement is a 400 that names it (``extra="forbid"``), never ignored.
An explicit ``null`` for an optional field means the field is absent, as OpenAI's API treats it.
Integers are bounded to what the engines' wire format carries, so an out-of-range value is a 400
here instead of a failure after the request was placed.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic_core import PydanticCustomError
from crescent.services.gateway.choices import MAX_CHOICES
from crescent.services.gateway.logprobs_api import ChatLogprobs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_validator,
    model_serializer,
)

MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {key for name, f in cls.model_fields.items() if not f.is_required() for key in (name, f.alias)}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class AssistantToolCall(RequestModel):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class Message(RequestModel):
    # Declared before content: its validator reads them.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[AssistantToolCall] | None = None
    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = Field(
        default=None, description="Kimi K3's dynamic tools: declared here, callable from the next turn on")
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    reasoning_content: str | None = Field(default=None, description="extension: an assistant turn's reasoning")

    @field_validator("tools")
    @classmethod
    def _system_only(cls, value: object, info: ValidationInfo) -> object:
        if value is not None and info.data.get("role") not in ("system", "developer"):
            raise PydanticCustomError("extra_forbidden", "only system messages declare {field} (dynamic tools)",
                                      {"field": info.field_name})
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_results_name_their_call(cls, value: object, info: ValidationInfo) -> object:
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return value

    @field_validator("tool_calls", "reasoning_content")
    @classmethod
    def _assistant_only(cls, value: object, info: ValidationInfo) -> object:
        if value is not None and info.data.get("role") != "assistant":
            # Reported like an unknown field: in such a message it is not a parameter at all.
            raise PydanticCustomError("extra_forbidden", "only assistant messages carry {field}",
                                      {"field": info.field_name})
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_tool_calls(cls, value: object, info: ValidationInfo) -> object:
        if info.data.get("tools") and value not in (None, ""):
            raise ValueError("a system message that declares tools carries no content (Kimi K3's dynamic tools)")
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")) \
                and not info.data.get("tools"):
            raise ValueError("content is required, except in an assistant message with tool_calls "
                             "or a system message with tools")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # an empty schema ({}): any JSON value
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class ThinkingOption(RequestModel):
    """Kimi's switch between thinking and instant replies; K3 adds ``keep`` (which earlier turns keep
    their reasoning in the prompt: "all") and ``effort`` (how much to reason; wins over
    ``reasoning_effort``). Which values a model takes is its card's (model_policy.py)."""

    type: Literal["enabled", "disabled"]
    keep: str | None = Field(default=None, max_length=32)
    effort: str | None = Field(default=None, max_length=32)


class StructuredOutputs(RequestModel):
    """Extension (vLLM's name and fields): exactly one of these constrains the output."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(default=None, min_length=1, description="a Lark grammar (llguidance's dialect)")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar")
        return self


class ChatCompletionRequest(RequestModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX, description="extension; 0 or -1: off")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="choices (docs/api.md, \"n > 1\")")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="extension; 1: off")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024, description="token id (as a string) -> bias added to its logit")
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX, description="extension: stop tokens held back until then")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(max_length=64)] | None = Field(
        default=None, description="extension: token ids that end the reply, besides the model's own")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="extension: regex, choice, grammar")
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning controls; which values a model takes is its card's (model_policy.py).
    reasoning_effort: str | None = Field(default=None, max_length=32)
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="variables for the chat template")
    cache_salt: str | None = Field(default=None, description="extension: isolates a tenant's prefix cache")
    ignore_eos: bool = Field(default=False, description="extension: generate max_tokens even past end-of-sequence")
    # Accepted and ignored: they mean nothing on this platform (docs/api.md says why for each).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def all_tools(self) -> list[ToolDefinition]:
        """The request's ``tools`` and the dynamic tools its messages declare (``messages[i].tools``)."""
        return [*(self.tools or ()), *(t for m in self.messages for t in m.tools or ())]

    def offers_tools(self) -> bool:
        """Tools are given and may be called: render them into the prompt and parse calls from the reply."""
        return bool(self.all_tools()) and self.tool_choice != "none"

    def constrains_output(self) -> bool:
        return (self.response_format is not None and self.response_format.type != "text") or (
            self.structured_outputs is not None)

    def forces_tool_call(self) -> bool:
        return bool(self.all_tools()) and (self.tool_choice == "required" or isinstance(self.tool_choice,
                                                                                         NamedToolChoice))

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported_values(self) -> list[tuple[str, str]]:
        """(param, why) for every accepted parameter set to a value the platform cannot honour."""
        problems = []
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            problems.append(("structured_outputs", "give either response_format or structured_outputs, not both"))
        if self.constrains_output() or self.forces_tool_call():
            if self.stop is not None:
                problems.append(("stop", "stop strings would cut a structured output short of its format"))
            if self.ignore_eos:
                problems.append(("ignore_eos", "a structured output ends where its format does"))
        offered = self.all_tools()
        if self.tool_choice not in (None, "none", "auto") and not offered:
            problems.append(("tool_choice", "this tool_choice needs tools"))
        elif isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in offered}:
            problems.append(("tool_choice", f"no tool named {self.tool_choice.function.name!r} is offered"))
        return problems


FinishReason = Literal["stop", "length", "tool_calls"]
# A stream that could not finish ends with this finish_reason on the chunk that carries its error.
StreamFinishReason = FinishReason | Literal["error"]


class _DropsNone(BaseModel):
    """Serializes without the fields that are None (OpenAI omits them in deltas and messages)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k in self.KEEP_NONE}

    KEEP_NONE: ClassVar[frozenset[str]] = frozenset()


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens generated up to the end of the reasoning (included in completion_tokens)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_DropsNone):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the reply is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    KEEP_NONE: ClassVar[frozenset[str]] = frozenset({"content"})


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class FunctionDelta(_DropsNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(_DropsNone):
    """A piece of a streamed tool call: id, type and name come once, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(_DropsNone):
    """A delta carries only what changed: the role once, then content, reasoning or tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: StreamFinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "crescent"
    max_model_len: int
    policy: dict[str, Any] | None = None  # extension: reasoning controls, sampling defaults, locked parameters


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
