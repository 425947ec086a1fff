"""The OpenAI-compatible HTTP contract of ``/v1/chat/completions`` and ``/v1/models``.

Requests are strict: a field of the wrong type is a 400, not a silent coercion, and a parameter
the platform does not implement is a 400 that names it (``extra="forbid"``), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_STOP_STRINGS = 4


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class Message(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(RequestModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="extension; 0 or -1: off")
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    # Accepted only at the value that means "off"; anything else is refused by name.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    user: str | None = None
    cache_salt: str | None = Field(default=None, description="extension: isolates a tenant's prefix cache")

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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported_values(self) -> list[tuple[str, str]]:
        """(param, why) for every accepted parameter set to a value the platform cannot honour."""
        problems = []
        if self.n != 1:
            problems.append(("n", "only n=1 is supported"))
        if self.presence_penalty != 0:
            problems.append(("presence_penalty", "only presence_penalty=0 is supported"))
        if self.frequency_penalty != 0:
            problems.append(("frequency_penalty", "only frequency_penalty=0 is supported"))
        if self.logprobs:
            problems.append(("logprobs", "logprobs are not supported"))
        return problems


FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        # A delta carries only what changed: the role once, then content.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
