"""From a chat request to prompt token ids: the chat template, tokenization and length checks.

The gateway needs only this much of a tokenizer (``crescent.services.engine.tokenizer.Tokenizer``
provides it); tests inject a small fake with the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.errors import ContextLengthExceededError, InvalidRequestError


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Feed one generated token; return only the text it completes (may be empty)."""
        ...


class ChatTokenizer(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...

    def new_detokenizer(self) -> Detokenizer: ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the gateway knows about the model it fronts."""

    tokenizer: ChatTokenizer
    model_id: str                     # names the model to the engines and in block keys
    context_window: int               # prompt + completion tokens
    template_errors: tuple[type[Exception], ...] = ()  # errors meaning "these messages don't fit the template"


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int


# The chat templates of the models we serve know system/user/assistant/tool; "developer" is
# OpenAI's newer name for a system message.
_TEMPLATE_ROLE = {"developer": "system"}


def build_prompt(request: ChatCompletionRequest, model: ServedModel, default_max_tokens: int) -> Prompt:
    """Render and tokenize the request's messages; check that prompt plus completion fit."""
    messages = [{"role": _TEMPLATE_ROLE.get(m.role, m.role), "content": m.text()} for m in request.messages]
    try:
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except model.template_errors as exc:
        raise InvalidRequestError(f"messages do not fit the model's chat template: {exc}", param="messages") from exc
    token_ids = tuple(model.tokenizer.encode(text))
    window = model.context_window
    if len(token_ids) >= window:
        raise ContextLengthExceededError(
            f"this model's context window is {window} tokens; the messages take {len(token_ids)} tokens, "
            "leaving no room for a completion",
            param="messages",
        )
    requested = request.requested_max_tokens()
    if requested is None:
        return Prompt(token_ids, min(default_max_tokens, window - len(token_ids)))
    if len(token_ids) + requested > window:
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        raise ContextLengthExceededError(
            f"this model's context window is {window} tokens; the messages take {len(token_ids)} tokens and "
            f"{requested} completion tokens were requested ({len(token_ids) + requested} in all)",
            param=param,
        )
    return Prompt(token_ids, requested)
