"""Kimi K3's chat format ("XTML"), rendered the way K3's own encoder renders it.

K3 ships no Jinja template: its release builds prompts with a Python program
(``encoding_k3.py``, ``build_chat_segments``) that emits a list of segments, each either markup
(special tokens allowed) or text (encoded as plain text), BPE-encoded one segment at a time. The
facts below come from public references (vLLM's ``kimi_k3`` reasoning and tool parsers, and
independent ports and tests of ``encoding_k3.py``); see docs/k3.md, "K3's chat format":

- four special tokens: ``<|open|>`` (163587), ``<|close|>`` (163588), ``<|sep|>`` (163589),
  ``<|end_of_msg|>`` (163586, the end of a turn and the model's stop token);
- an element is ``<|open|>NAME ATTRS<|sep|>BODY<|close|>NAME<|sep|>``; attributes are
  `` key="value"`` with ``&`` then ``"`` escaped; a turn is a ``message`` element with a ``role``
  attribute followed by ``<|end_of_msg|>``;
- an assistant turn holds a ``think`` channel (present, maybe empty, whenever thinking is on,
  absent when it is off), a ``response`` channel, then an optional ``tools`` channel of ``call``
  elements (``tool="NAME" index="1"``) whose arguments are ``argument key=".." type=".."``
  elements (strings raw, other types as JSON) or one ``json type="object"`` element;
- a tool result is ``message role="tool" tool="NAME" index="N"`` (N counts the results after
  the assistant turn that called them, in the order of its calls);
- tools are declared in a ``message role="system" type="tool-declare"`` first; tools carried by
  a later system message (``messages[i].tools``, dynamic tools) are declared where that message
  stands, as "New Tools Available";
- the reasoning effort (``low``/``high``/``max``) is a ``type="thinking-effort"`` system message
  after the tool declaration (thinking only); ``tool_choice`` required/none and a JSON
  ``response_format`` are ``type="tool-choice"``/``"response-format"`` system messages after the
  conversation;
- the generation prompt opens an assistant message and its ``think`` channel (thinking) or its
  ``response`` channel (instant).

``render_k3_chat`` returns the prompt as a string in which every text segment is wrapped in
``literal_text``'s marks, so ``literal_text.encode_marked`` encodes it segment by segment,
exactly as K3's encoder does (token counts equal the real format's), and client text can never
become markup.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from crescent.services.model.chat_template import ChatTemplateError
from crescent.services.model.literal_text import CLOSE as LIT_CLOSE
from crescent.services.model.literal_text import OPEN as LIT_OPEN

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
# K3's tokenizer_config.json names these ids; the rest of the 256 reserved ids are as in K2's.
K3_SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {  # id -> (text, skipped by decode)
    163586: (END_OF_MSG, True),
    163587: (OPEN, False),
    163588: (CLOSE, False),
    163589: (SEP, False),
}
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"


class K3FormatError(ChatTemplateError):
    """A conversation K3's format cannot express; the message says why."""


def _plain(value: Any) -> str:
    # Client strings may arrive already marked as literal: every text segment is literal here.
    return str(value).replace(LIT_OPEN, "").replace(LIT_CLOSE, "")


def _text(value: Any) -> str:
    text = _plain(value)
    return f"{LIT_OPEN}{text}{LIT_CLOSE}" if text else ""


def _attr(key: str, value: Any) -> str:
    escaped = _plain(value).replace("&", "&amp;").replace('"', "&quot;")
    return _text(f" {key}") + _text('="') + _text(escaped) + _text('"')


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> str:
    return OPEN + _text(tag) + "".join(_attr(k, v) for k, v in attrs) + SEP


def _close(tag: str) -> str:
    return CLOSE + _text(tag) + SEP


def _message(attrs: Sequence[tuple[str, Any]], body: str) -> str:
    return _open("message", attrs) + body + _close("message") + END_OF_MSG


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sorted(value: Any) -> Any:
    """Every mapping sorted by key (K3's encoder does this to tools and schemas)."""
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content)
    return "".join(_text(part.get("text", "")) for part in content if part.get("type") == "text")


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def _arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """(typed arguments, raw JSON text when it does not parse)."""
    if raw is None or (isinstance(raw, str) and not _plain(raw).strip()):
        return {}, None
    if isinstance(raw, Mapping):
        return dict(raw), None
    text = _plain(raw)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return {}, text
    if not isinstance(parsed, dict):
        raise K3FormatError("a tool call's arguments must be a JSON object in Kimi K3's format")
    return parsed, None


def _call(call: Mapping[str, Any], index: int) -> str:
    function = call.get("function", call)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise K3FormatError("a tool call needs a function name")
    arguments, raw = _arguments(function.get("arguments"))
    if raw is not None:
        body = _open("json", [("type", "object")]) + _text(raw) + _close("json")
    else:
        body = "".join(_open("argument", [("key", key), ("type", _value_type(value))])
                       + _text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                       + _close("argument") for key, value in arguments.items())
    return _open("call", [("tool", name), ("index", index)]) + body + _close("call")


def _assistant(message: Mapping[str, Any], thinking: bool) -> str:
    out = ""
    if thinking:
        reasoning = message.get("reasoning_content") or ""
        out += _open("think") + (_text(reasoning) if _plain(reasoning).strip() else "") + _close("think")
    out += _open("response") + _content(message.get("content")) + _close("response")
    calls = message.get("tool_calls") or []
    if calls:
        out += _open("tools") + "".join(_call(c, i) for i, c in enumerate(calls, start=1)) + _close("tools")
    attrs = [("role", "assistant")] + ([("name", message["name"])] if message.get("name") else [])
    return _message(attrs, out)


def _declare(tools: Any, *, dynamic: bool) -> str:
    if dynamic:
        body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools."
                f"\n\n```json\n{_compact(_sorted(tools))}\n```")
    else:
        body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{_compact(_sorted(tools))}\n```"
    return _message([("role", "system"), ("type", "tool-declare")], _text(body))


def _note(kind: str, body: str) -> str:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _ordered_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results put in the order of the calls they answer, named after them.

    K3 binds a result to its call by position; an OpenAI client binds by ``tool_call_id`` and may
    send results in any order. A run that does not match the calls one to one is left as sent."""
    out: list[dict[str, Any]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                calls = {}
                for position, call in enumerate(message.get("tool_calls") or (), start=1):
                    calls.setdefault(_plain(call.get("id")), (position, call.get("function", call).get("name")))
            out.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            run.append(dict(messages[i]))
            i += 1
        matched = [calls.get(_plain(m.get("tool_call_id"))) for m in run]
        if all(matched) and len({m[0] for m in matched if m}) == len(run):
            pairs = sorted(zip(matched, run), key=lambda pair: pair[0][0])  # type: ignore[index]
            run = [{**m, "name": match[1]} for match, m in pairs]  # type: ignore[index]
        out += run
    return out


def render_k3_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
                   add_generation_prompt: bool = True, thinking: bool = True, thinking_effort: str | None = None,
                   tool_choice: Any = None, response_format: Mapping[str, Any] | None = None) -> str:
    """The prompt of a conversation in K3's format, text segments marked literal (module docstring).

    ``thinking_effort`` (low/high/max) is written only when thinking is on; ``tool_choice``
    "required"/"none" and a ``json_object``/``json_schema`` ``response_format`` add K3's notes."""
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise K3FormatError(f"thinking effort {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}")
    out = _declare(list(tools), dynamic=False) if tools else ""
    if thinking and thinking_effort is not None:
        out += _note("thinking-effort",
                     "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                     "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                     f"Now the system is invoked with `thinking_effort={thinking_effort}`.")
    index, calls = 0, []
    for message in _ordered_results(messages):
        role = message.get("role")
        named = [("name", message["name"])] if message.get("name") else []
        if role == "user":
            out += _message([("role", "user"), *named], _content(message.get("content")))
        elif role == "system" and message.get("tools"):
            out += _declare(message["tools"], dynamic=True)
        elif role == "system":
            out += _message([("role", "system"), *named], _content(message.get("content")))
        elif role == "assistant":
            index, calls = 0, list(message.get("tool_calls") or ())
            out += _assistant(message, thinking)
        elif role == "tool":
            index += 1
            if not message.get("name") and index <= len(calls):  # by position, as K3's encoder does
                message["name"] = calls[index - 1].get("function", calls[index - 1]).get("name")
            if not message.get("name"):
                raise K3FormatError("a tool result must answer a call of the assistant turn before it (tool_call_id)"
                                    " or name its tool")
            out += _message([("role", "tool"), ("tool", message["name"]), ("index", index)],
                            _content(message.get("content")))
        else:
            raise K3FormatError(f"unknown role {role!r}")
    if tool_choice == "required":
        out += _note("tool-choice", "The system is invoked with `tool_choice=required`.\n"
                                    "You MUST call tools in the next message.")
    elif tool_choice == "none":
        out += _note("tool-choice", "The system is invoked with `tool_choice=none`.\n"
                                    "You MUST NOT call any tools in the next message.")
    kind = (response_format or {}).get("type")
    raw_json = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
                "formatting.")
    if kind == "json_object":
        out += _note("response-format", f"The system is invoked with `response_format=json_object`.\n{raw_json}")
    elif kind == "json_schema":
        schema = _sorted((response_format or {}).get("json_schema", {}).get("schema"))
        out += _note("response-format", f"The system is invoked with `response_format=json_schema`.\n{raw_json}\n"
                                        f"The JSON data must match the following schema:\n```json\n{_compact(schema)}\n```")
    if add_generation_prompt:
        out += _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")
    return out
