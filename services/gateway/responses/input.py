"""From a Responses request (and the stored conversation it continues) to a chat request.

A response is generated exactly as a chat completion is: the request becomes a
``ChatCompletionRequest`` and chat builds the prompt, the constraint, the sampling and the stop
rule (``ChatCompletions.generation_request``). Items map to chat messages:

- ``instructions`` → a system message first (not stored: a follow-up gives its own);
- a message item → a message of its role; ``output_text`` parts are an earlier reply's text;
- ``function_call`` items → ``tool_calls`` of one assistant message (with the assistant text
  just before them, if any);
- ``function_call_output`` → a ``tool`` message for that ``call_id``;
- a ``reasoning`` item → ``reasoning_content`` of the assistant turn that follows it (dropped
  when no assistant turn follows).

Errors from chat name chat's fields; ``responses_error`` renames them to this API's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.errors import ApiError, validation_error
from crescent.services.gateway.responses.api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponseRequest,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

# Chat's parameter (by prefix) -> this API's; the rest keep their names.
_PARAMS = [
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^(max_completion_tokens|max_tokens)$"), "max_output_tokens"),
    (re.compile(r"^response_format\b.*"), "text.format"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^tools(\[\d+\])\.function\b"), r"tools\1"),
]


def responses_param(param: str | None) -> str | None:
    """Chat's name of a parameter as this API names it."""
    if param is None:
        return None
    for pattern, name in _PARAMS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def responses_error(error: ApiError) -> ApiError:
    """``error`` (raised on chat's path) naming this API's parameter, in its ``param`` and message."""
    renamed = responses_param(error.param)
    if renamed != error.param and error.param is not None:
        if re.search(r"[_.\[]", error.param):  # a field name in the message, not a word ("messages")
            error.message = error.message.replace(error.param, renamed or "", 1)
        error.param = renamed
    return error


def chat_messages(items: Sequence[Item]) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module docstring for the mapping)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def calling_assistant() -> dict[str, Any]:
        """The assistant message a call joins: the one just before it, unless reasoning came between."""
        if not reasoning and messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
        elif isinstance(item, FunctionCallItem):
            message = calling_assistant()
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            reasoning.clear()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.role == "assistant":
            message = {"role": "assistant", "content": item.text()}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning.clear()
            messages.append(message)
        else:
            reasoning.clear()
            messages.append({"role": item.role, "content": item.text()})
    for message in messages:
        if message["role"] == "assistant" and message["content"] is None and not message.get("tool_calls"):
            message["content"] = ""
    return messages


def _tool_choice(body: ResponseRequest) -> object:
    choice = body.tool_choice
    if choice is None or (choice == "auto" and not body.tools):
        return None  # Responses' default is "auto", with or without tools
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(body: ResponseRequest) -> dict[str, Any] | None:
    fmt = body.text_format()
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_request(body: ResponseRequest, conversation: Sequence[Item]) -> ChatCompletionRequest:
    """The chat request that generates this response; ``conversation``: stored items, then this input.

    Raises an ``ApiError`` naming this API's parameter where chat refuses a value."""
    messages = chat_messages(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                  for tool in body.tools or ()] or None,
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    }
    for param in ("temperature", "top_p"):  # only when given: the model card may default or fix them
        if param in body.model_fields_set:
            fields[param] = getattr(body, param)
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort  # chat decides which values it takes
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise responses_error(validation_error(exc.errors())) from None
