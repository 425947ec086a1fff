"""Parse tool calls written as ``<tool_call>{json}</tool_call>`` (the Hermes/Qwen style).

The default tool prompt (``default_tools``) asks a model to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``JsonToolCallParser`` has the interface of ``tool_calls.ToolCallParser`` and emits the same
events, so a client sees the same OpenAI stream either way: the header of a call (index, a new
``call_<random>`` id, the name) once, then its arguments. A call is held back until its closing
tag arrives and is checked then: only a JSON object with a string ``name`` and an object of
``arguments`` (``parameters`` is taken too) becomes a tool call, its ``arguments`` the JSON text
of that object. Anything else inside the tags — malformed JSON, another shape, a call cut off
by the end of the reply — is passed on verbatim as content, so a client never receives a call
whose arguments do not parse. (The price: a call's arguments arrive in one piece, when the call
is complete, not token by token as Kimi's do.)

Text before the first call is content, kept as written. After a call, whitespace up to the next
call or the end is dropped (models put newlines between calls); other text there is content.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from enum import Enum
from typing import Any

from crescent.services.gateway.parsing.reasoning import partial_suffix_len
from crescent.services.gateway.parsing.tool_calls import ContentText, ToolCallArguments, ToolCallEvent, ToolCallHeader


@dataclass(frozen=True, slots=True)
class JsonToolCallTags:
    begin: str
    end: str


HERMES_TOOL_CALL_TAGS = JsonToolCallTags(begin="<tool_call>", end="</tool_call>")

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id in OpenAI's style (``call_`` and 24 random letters and digits), unique in practice."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def parse_call(body: str) -> ParsedCall | None:
    """The call written between the tags, or None when it is not one."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models encode the object a second time
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class _State(Enum):
    TEXT = 1  # content, before, between or after calls
    CALL = 2  # after <tool_call>, holding the call until </tool_call>


class JsonToolCallParser:
    """Feed content with ``push``; call ``finish`` at the end of the reply."""

    def __init__(self, tags: JsonToolCallTags = HERMES_TOOL_CALL_TAGS) -> None:
        self._tags = tags
        self._state = _State.TEXT
        self._pending = ""
        self._after_call = False  # whitespace after a call is dropped
        self.completed_calls = 0  # also the index of the next call

    def push(self, text: str) -> list[ToolCallEvent]:
        self._pending += text
        out: list[ToolCallEvent] = []
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> list[ToolCallEvent]:
        """Release what was held back: a call without its closing tag is content, as written."""
        tail, self._pending = self._pending, ""
        if self._state is _State.CALL:
            return [ContentText(self._tags.begin + tail)]
        tail = tail.lstrip() if self._after_call else tail
        return [ContentText(tail)] if tail else []

    def _step(self, out: list[ToolCallEvent]) -> bool:
        """Consume what can be decided of the pending text; False when it must wait for more."""
        tags = self._tags
        if self._state is _State.CALL:
            cut = self._pending.find(tags.end)
            if cut < 0:
                return False
            body, self._pending, self._state = self._pending[:cut], self._pending[cut + len(tags.end):], _State.TEXT
            call = parse_call(body)
            if call is None:
                out.append(ContentText(tags.begin + body + tags.end))
                return True
            index = self.completed_calls
            out += [ToolCallHeader(index, new_call_id(), call.name), ToolCallArguments(index, call.arguments)]
            self.completed_calls += 1
            self._after_call = True
            return True
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
        cut = self._pending.find(tags.begin)
        if cut >= 0:
            if cut:
                out.append(ContentText(self._pending[:cut]))
            self._pending, self._state = self._pending[cut + len(tags.begin):], _State.CALL
            self._after_call = False
            return True
        hold = partial_suffix_len(self._pending, (tags.begin,))
        text, self._pending = self._pending[:len(self._pending) - hold], self._pending[len(self._pending) - hold:]
        if text:
            out.append(ContentText(text))
            self._after_call = False
        return False
