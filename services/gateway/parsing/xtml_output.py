"""Split a Kimi K3 reply (XTML, ``services.model.kimi_k3_format``) into reasoning, content and tool calls.

The prompt ends by opening the reply's first channel, so the reply starts inside it: inside
``think`` when thinking is on (``<|open|>think<|sep|>`` was the prompt's last markup), inside
``response`` when it is off. From there the model writes::

    reasoning<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>

and stops with ``<|end_of_msg|>``. A call's header (name) is sent once its opening tag is
complete; its arguments are sent as one JSON object when the call closes (string arguments are
raw text, the others JSON, as the ``type`` attribute says; a ``json`` element holds the whole
object). Markers may span several pieces of text: a tail that may still grow into one is held
back. Text outside any channel is content; calls are dropped when tools were not offered.
Call ids take the form ``functions.NAME:N`` (N counts the reply's calls from 0).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass

from crescent.services.gateway.parsing.reasoning import partial_suffix_len
from crescent.services.gateway.parsing.tool_calls import ContentText, ToolCallArguments, ToolCallHeader

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
CALL_OPEN, CALL_CLOSE = f"{OPEN}call", f"{CLOSE}call{SEP}"

_ATTR = re.compile(r'(\w+)="([^"]*)"')
_ELEMENT = re.compile(re.escape(OPEN) + r"(argument|json)\b([^<]*?)" + re.escape(SEP) + r"(.*?)"
                      + re.escape(CLOSE) + r"\1" + re.escape(SEP), re.S)


@dataclass(frozen=True, slots=True)
class ReasoningText:
    text: str


XtmlEvent = ReasoningText | ContentText | ToolCallHeader | ToolCallArguments


def _attrs(text: str) -> dict[str, str]:
    return {k: html.unescape(v) if "&" in v else v for k, v in _ATTR.findall(text)}


def call_arguments(body: str) -> str:
    """The JSON object of a call's body (its ``argument`` elements, or its ``json`` element)."""
    arguments: dict[str, object] = {}
    for tag, attrs, value in _ELEMENT.findall(body):
        if tag == "json":
            return value
        attr = _attrs(attrs)
        if attr.get("type", "string") == "string":
            arguments[attr.get("key", "")] = value
            continue
        try:
            arguments[attr.get("key", "")] = json.loads(value)
        except json.JSONDecodeError:
            arguments[attr.get("key", "")] = value
    return json.dumps(arguments, ensure_ascii=False)


class XtmlReplyParser:
    """Feed reply text with ``push``; call ``finish`` at the end of the reply."""

    def __init__(self, *, thinking: bool, tools: bool) -> None:
        self._channel = "think" if thinking else "response"  # think | response | tools | call | outside | done
        self._at_start = True
        self._tools = tools
        self._pending = ""
        self._call_name = ""
        self._index = 0
        self.completed_calls = 0

    @property
    def in_reasoning(self) -> bool:
        return self._channel == "think"

    def push(self, text: str) -> list[XtmlEvent]:
        self._pending += text
        out: list[XtmlEvent] = []
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> list[XtmlEvent]:
        """What was held back, on its channel; a call cut off mid-way keeps what it had."""
        tail, self._pending = self._pending, ""
        if self._channel == "think" and tail:
            return [ReasoningText(tail)]
        if self._channel in ("response", "outside") and tail:
            return [ContentText(tail)]
        if self._channel == "call" and self._tools:
            return [ToolCallArguments(self._index, call_arguments(tail))]
        return []

    def _step(self, out: list[XtmlEvent]) -> bool:
        if self._at_start:  # the channel's own opening may be repeated by the model: skip it
            opening = THINK_OPEN if self._channel == "think" else RESPONSE_OPEN
            if opening.startswith(self._pending.lstrip()) and len(self._pending.lstrip()) < len(opening):
                return False
            self._at_start = False
            if self._pending.lstrip().startswith(opening):
                self._pending = self._pending.lstrip()[len(opening):]
                return True
        channel = self._channel
        if channel == "think":
            return self._text_until(out, ReasoningText, {THINK_CLOSE: "outside", RESPONSE_OPEN: "response"})
        if channel == "response":
            return self._text_until(out, ContentText, {RESPONSE_CLOSE: "outside", TOOLS_OPEN: "tools",
                                                       MESSAGE_CLOSE: "done"})
        if channel == "outside":
            return self._text_until(out, ContentText, {RESPONSE_OPEN: "response", TOOLS_OPEN: "tools",
                                                       THINK_OPEN: "think", MESSAGE_CLOSE: "done"})
        if channel == "tools":
            return self._in_tools(out)
        if channel == "call":
            cut = self._pending.find(CALL_CLOSE)
            if cut < 0:
                return False  # arguments are sent whole, when the call closes
            if self._tools:
                out.append(ToolCallArguments(self._index, call_arguments(self._pending[:cut])))
                self.completed_calls += 1
            self._pending, self._channel = self._pending[cut + len(CALL_CLOSE):], "tools"
            self._index += 1
            return True
        self._pending = ""  # done: nothing after the message's end is part of the reply
        return False

    def _in_tools(self, out: list[XtmlEvent]) -> bool:
        pending = self._pending
        found = [(i, m) for m in (CALL_OPEN, TOOLS_CLOSE) if (i := pending.find(m)) >= 0]
        if not found:
            hold = partial_suffix_len(pending, (CALL_OPEN, TOOLS_CLOSE))
            self._pending = pending[len(pending) - hold:]  # between calls only markup counts
            return False
        cut, marker = min(found)
        if marker == TOOLS_CLOSE:
            self._pending, self._channel = pending[cut + len(marker):], "outside"
            return True
        end = pending.find(SEP, cut)
        if end < 0:
            return False  # the call's opening tag is short: wait for all of it
        name = _attrs(pending[cut + len(CALL_OPEN):end]).get("tool", "") or "unknown"
        if self._tools:
            out.append(ToolCallHeader(self._index, f"functions.{name}:{self._index}", name))
        self._pending, self._channel = pending[end + len(SEP):], "call"
        return True

    def _text_until(self, out: list[XtmlEvent], make: type[ReasoningText] | type[ContentText],
                    ends: dict[str, str]) -> bool:
        pending = self._pending
        found = [(i, m) for m in ends if (i := pending.find(m)) >= 0]
        if not found:
            hold = partial_suffix_len(pending, tuple(ends))
            if len(pending) > hold:
                out.append(make(pending[:len(pending) - hold]))
            self._pending = pending[len(pending) - hold:]
            return False
        cut, marker = min(found)
        if cut:
            out.append(make(pending[:cut]))
        self._pending, self._channel = pending[cut + len(marker):], ends[marker]
        return True
