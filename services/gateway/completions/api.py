"""The OpenAI-compatible HTTP contract of ``/v1/completions`` (legacy text completions).

The same conventions as ``api_models`` (chat): strict types, unknown fields refused by name,
an explicit ``null`` means absent, integers bounded to what the engines' wire format carries.
A parameter the platform accepts but cannot honour yet (``suffix``, penalties, ...)
is refused by ``unsupported_values`` with a 400 naming it, never silently ignored.

``prompt`` takes OpenAI's four forms: a string, a list of strings, a list of token ids, or a
list of token-id lists. Each item of a list has ``n`` choices of its own (``index`` = its
position * n + i, as OpenAI numbers them; ``choices`` generates them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from crescent.services.gateway.api_models import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRINGS,
    RequestModel,
    StreamOptions,
    Usage,
)
from crescent.services.gateway.choices import MAX_CHOICES
from crescent.services.gateway.logprobs_api import CompletionLogprobs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint (chat's is "as long as it fits")
MAX_PROMPTS = 128        # prompts in one request: each becomes a backend request of its own
MAX_CHOICES_PER_REQUEST = MAX_PROMPTS  # prompts * n: backend requests of one request

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompts = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenPrompts = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
_PROMPT_FORMS = (
    f"prompt must be a string, a list of strings, a list of token ids (integers 0 to {INT32_MAX}) or a list of "
    f"token-id lists; a list holds at most {MAX_PROMPTS} prompts"
)


class CompletionRequest(RequestModel):
    model: str
    # Plain ``list[int]`` before ``list[list[int]]``: strict mode keeps the forms apart.
    prompt: str | Prompts | TokenIds | TokenPrompts
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX, description="extension; 0 or -1: off")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = Field(default=False, description="the choice's text starts with its prompt")
    cache_salt: str | None = Field(default=None, description="extension: isolates a tenant's prefix cache")
    ignore_eos: bool = Field(default=False, description="extension: generate max_tokens even past end-of-sequence")
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="choices per prompt (docs/api.md, \"n > 1\")")
    # Accepted only at the value that means "off"; anything else is refused by name.
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5, description="alternatives per token (docs/logprobs.md)")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(default=None, max_length=1024)
    # Accepted and ignored: an end-user id for abuse tracking means nothing here.
    user: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_form(cls, value: object, handler: ValidatorFunctionWrapHandler) -> object:
        # One plain message instead of one line per union member that did not match.
        if value in ("", []) or (isinstance(value, list) and any(item in ("", []) for item in value)):
            raise ValueError("a prompt must not be empty")
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(_PROMPT_FORMS) from None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: the prompt's text, or its token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]  # the list[int] form
        return list(self.prompt)  # type: ignore[arg-type]  # list[str] or list[list[int]]

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def max_tokens_given(self) -> bool:
        """The client chose max_tokens (then a prompt it does not fit beside is a 400, not a clamp)."""
        return "max_tokens" in self.model_fields_set

    def unsupported_values(self) -> list[tuple[str, str]]:
        """(param, why) for every accepted parameter set to a value the platform cannot honour."""
        problems = []
        if self.best_of not in (None, self.n):
            problems.append(("best_of", "best_of (choosing the best of more generations than n) is not supported; "
                                        "leave it unset or equal to n"))
        if self.suffix is not None:
            problems.append(("suffix", "suffix (text insertion) is not supported"))
        if self.logprobs is not None and self.echo:
            problems.append(("echo", "echo with logprobs needs the prompt's log-probabilities, which are not computed"))
        return problems


CompletionFinishReason = Literal["stop", "length"]
# A stream that could not finish ends each open choice with this on the chunk that carries its error.
CompletionStreamFinishReason = CompletionFinishReason | Literal["error"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: CompletionFinishReason
    logprobs: CompletionLogprobs | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: CompletionStreamFinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class TextCompletionChunk(BaseModel):
    """A streamed piece: OpenAI streams ``text_completion`` objects carrying incremental text."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
