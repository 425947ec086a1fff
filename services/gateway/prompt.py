"""From a chat request to prompt token ids: the chat template, tokenization and length checks.

The gateway needs only this much of a tokenizer (``crescent.services.model.tokenizer.Tokenizer``
provides it); tests inject a small fake with the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from crescent.services.contract.context_window import ContextWindowExceeded, completion_budget
from crescent.services.gateway.api_models import ChatCompletionRequest, Message
from crescent.services.gateway.parsing.default_tools import with_default_tools
from crescent.services.gateway.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    UnsupportedParameterError,
)
from crescent.services.gateway.model_policy import NO_POLICY, ModelPolicy
from crescent.services.gateway.parsing.output_format import PLAIN_OUTPUT, OutputFormat
from crescent.services.model.literal_text import ReservedCharacterError, encode_marked, mark_literals


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Feed one generated token; return only the text it completes (may be empty)."""
        ...


class ChatTokenizer(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def contains_control_text(self, text: str) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (logprobs report them)."""
        ...

    def encode_as_text(self, text: str) -> list[int]:
        """Encode with control-token strings as plain text (``services.model.literal_text``)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str: ...

    def new_detokenizer(self) -> Detokenizer: ...


class ToolChatTokenizer(ChatTokenizer, Protocol):
    """A tokenizer whose chat format also renders tool definitions (``KimiTokenizer``)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_vars: Any) -> str: ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the gateway knows about the model it fronts."""

    tokenizer: ChatTokenizer
    model_id: str                     # names the model to the engines and in block keys
    context_window: int               # prompt + completion tokens
    template_errors: tuple[type[Exception], ...] = ()  # errors meaning "these messages don't fit the template"
    # Reasoning/tool-call markup; tools need a ToolChatTokenizer unless the gateway renders them.
    output_format: OutputFormat = PLAIN_OUTPUT
    policy: ModelPolicy = NO_POLICY   # reasoning controls, sampling defaults and locks (the model card)


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int


# The chat templates of the models we serve know system/user/assistant/tool; "developer" is
# OpenAI's newer name for a system message.
_TEMPLATE_ROLE = {"developer": "system"}


def _template_message(message: Message) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(message.role, message.role), "content": message.text()}
    if message.tool_calls:
        fields["content"] = None if message.content is None else message.text()
        fields["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            fields[key] = getattr(message, key)
    if message.tools:
        fields["tools"] = [tool.model_dump(exclude_none=True) for tool in message.tools]
    return fields


def _check_tools_supported(request: ChatCompletionRequest, model: ServedModel) -> None:
    if model.output_format.supports_tools:
        return
    why = "this model's chat template has no tool support"
    if request.offers_tools():  # tools with tool_choice "none" are never rendered: nothing to support
        raise UnsupportedParameterError(f"tools are not supported: {why}", param="tools")
    if any(m.tool_calls for m in request.messages):
        raise UnsupportedParameterError(f"messages with tool_calls are not supported: {why}", param="messages")


def _check_dynamic_tools(request: ChatCompletionRequest, model: ServedModel) -> None:
    """Tools declared inside messages are Kimi K3's: only its format says where they go."""
    if model.output_format.xtml:
        return
    for i, message in enumerate(request.messages):
        if message.tools:
            raise UnsupportedParameterError("tools declared in a message (dynamic tools) are not supported: this "
                                            "model's chat format has no place for them; use the request's tools",
                                            param=f"messages[{i}].tools")


def _render(request: ChatCompletionRequest, model: ServedModel) -> str:
    """The prompt text; client strings that hold control-token text come back marked as literal."""
    literal = model.tokenizer.contains_control_text
    messages = [_template_message(m) for m in request.messages]
    # K3's format declares tools even under tool_choice "none" (with a note not to call them).
    declared = request.offers_tools() or (model.output_format.xtml and bool(request.tools))
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()] if declared else None
    if model.output_format.gateway_renders_tools:
        # Tools, calls and results become plain message text, marked below like any client text.
        messages, tools = with_default_tools(messages, tools), None
    messages = mark_literals(messages, literal)
    template_vars = mark_literals(_template_vars(request), literal)
    if tools is None:
        return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_vars)
    tokenizer: ToolChatTokenizer = model.tokenizer  # type: ignore[assignment]  # supports_tools says so
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=mark_literals(tools, literal),
                                         **template_vars)


# Names the gateway itself gives the template; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "raise_exception", "strftime_now", "thinking", "enable_thinking",
                                    "reasoning_effort", "thinking_effort", "tool_choice", "response_format"})


def _template_vars(request: ChatCompletionRequest) -> dict[str, Any]:
    """``chat_template_kwargs``, plus the reasoning controls under the names templates use
    (``thinking``; ``enable_thinking`` as Qwen3's templates call it; ``reasoning_effort``;
    ``thinking_effort`` as K3's encoder calls it, set only when thinking is on), and
    ``tool_choice``/``response_format``, which K3's format writes into the prompt."""
    extra = dict(request.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARS & extra.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {clash[0]!r}: the gateway sets it"
                                  + (" (use the request's own field)" if clash[0] in {"thinking", "reasoning_effort"}
                                     else ""), param=f"chat_template_kwargs.{clash[0]}")
    if request.thinking is not None:
        extra["thinking"] = extra["enable_thinking"] = request.thinking.type == "enabled"
    if request.reasoning_effort is not None:
        extra["reasoning_effort"] = request.reasoning_effort
        if request.thinking is not None and request.thinking.type == "enabled":
            extra["thinking_effort"] = request.reasoning_effort
    if request.tool_choice is not None:
        choice = request.tool_choice
        extra["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    if request.response_format is not None:
        extra["response_format"] = request.response_format.model_dump(by_alias=True, exclude_none=True)
    return extra


def build_prompt(request: ChatCompletionRequest, model: ServedModel, default_max_tokens: int) -> Prompt:
    """Render and tokenize the request's messages; check that prompt plus completion fit."""
    _check_tools_supported(request, model)
    _check_dynamic_tools(request, model)
    try:
        text = _render(request, model)
        token_ids = tuple(encode_marked(text, model.tokenizer.encode, model.tokenizer.encode_as_text))
    except ReservedCharacterError as exc:
        raise InvalidRequestError(f"invalid text in the request: {exc}", param="messages") from exc
    except model.template_errors as exc:
        raise InvalidRequestError(f"messages do not fit the model's chat template: {exc}", param="messages") from exc
    requested = request.requested_max_tokens()
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = fit_completion(len(token_ids), model.context_window, requested, default_max_tokens,
                                subject="the messages take", prompt_param="messages", max_param=max_param)
    return Prompt(token_ids, max_tokens)


def fit_completion(prompt_tokens: int, window: int, requested: int | None, default: int, *,
                   subject: str, prompt_param: str, max_param: str) -> int:
    """``contract.context_window.completion_budget``, its refusal as the client's 400."""
    try:
        return completion_budget(prompt_tokens, window, requested, default)
    except ContextWindowExceeded as exc:
        if exc.requested is None:
            raise ContextLengthExceededError(
                f"this model's context window is {window} tokens; {subject} {prompt_tokens} tokens, "
                "leaving no room for a completion",
                param=prompt_param,
            ) from None
        raise ContextLengthExceededError(
            f"this model's context window is {window} tokens; {subject} {prompt_tokens} tokens and "
            f"{requested} completion tokens were requested ({prompt_tokens + exc.requested} in all)",
            param=max_param,
        ) from None
