"""Parse tool calls out of a reply's streamed content, in Kimi K2's native format.

The model writes, after any answer text::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>
    ... more calls ...
    <|tool_calls_section_end|>

``ToolCallParser`` turns that into events: plain text, the header of a call (its index in the
reply, its id and function name) once the id is complete, then the arguments as they stream.
Markers may span several pieces of text: a tail that may still grow into a marker is held back.
Inside the section only calls count (text between them is dropped); text after it is content.
The arguments are passed on as the model wrote them (OpenAI's ``arguments`` is a string the
client parses); ids keep the native ``functions.NAME:INDEX`` form, which the Kimi chat format
renders back when the client returns the call and its result.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from crescent.services.gateway.parsing.reasoning import partial_suffix_len


@dataclass(frozen=True, slots=True)
class ToolCallMarkers:
    section_begin: str
    section_end: str
    call_begin: str
    argument_begin: str
    call_end: str


KIMI_TOOL_CALL_MARKERS = ToolCallMarkers(
    section_begin="<|tool_calls_section_begin|>",
    section_end="<|tool_calls_section_end|>",
    call_begin="<|tool_call_begin|>",
    argument_begin="<|tool_call_argument_begin|>",
    call_end="<|tool_call_end|>",
)


@dataclass(frozen=True, slots=True)
class ContentText:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallHeader:
    index: int      # position of the call in this reply: 0, 1, ...
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    text: str       # a fragment: a call's arguments are the concatenation of its fragments


ToolCallEvent = ContentText | ToolCallHeader | ToolCallArguments

_NATIVE_ID = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", re.S)


def function_name(call_id: str) -> str:
    """``functions.get_weather:0`` → ``get_weather`` (tolerates a missing prefix or index)."""
    match = _NATIVE_ID.match(call_id)
    return match.group("name") if match else call_id


class _State(Enum):
    TEXT = 1       # answer text, outside the section
    SECTION = 2    # inside the section, between calls
    CALL_ID = 3    # after <|tool_call_begin|>, reading the id
    ARGUMENTS = 4  # after <|tool_call_argument_begin|>, streaming the arguments


class ToolCallParser:
    """Feed content with ``push``; call ``finish`` at the end of the reply."""

    def __init__(self, markers: ToolCallMarkers = KIMI_TOOL_CALL_MARKERS) -> None:
        self._m = markers
        self._state = _State.TEXT
        self._pending = ""
        self._index = 0           # of the call being read
        self.completed_calls = 0  # calls whose arguments were closed by <|tool_call_end|>

    def push(self, text: str) -> list[ToolCallEvent]:
        self._pending += text
        out: list[ToolCallEvent] = []
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> list[ToolCallEvent]:
        """Release what was held back. A call cut off inside its id is dropped (it has no name yet)."""
        tail, self._pending = self._pending, ""
        if self._state is _State.ARGUMENTS and tail:
            return [ToolCallArguments(self._index, tail)]
        if self._state is _State.TEXT and tail:
            return [ContentText(tail)]
        return []

    def _step(self, out: list[ToolCallEvent]) -> bool:
        """Consume what can be decided of the pending text; False when it must wait for more."""
        m, pending = self._m, self._pending
        if self._state is _State.TEXT:
            cut = pending.find(m.section_begin)
            if cut < 0:
                return self._release(out, ContentText, (m.section_begin,))
            _emit(out, ContentText(pending[:cut]))
            self._pending, self._state = pending[cut + len(m.section_begin):], _State.SECTION
            return True
        if self._state is _State.SECTION:
            # Between calls only markers count: whitespace or stray text there is dropped.
            found = [(i, marker, state)
                     for marker, state in ((m.call_begin, _State.CALL_ID), (m.section_end, _State.TEXT))
                     if (i := pending.find(marker)) >= 0]
            if not found:
                hold = partial_suffix_len(pending, (m.call_begin, m.section_end))
                self._pending = pending[len(pending) - hold:]
                return False
            cut, marker, state = min(found)
            self._pending, self._state = pending[cut + len(marker):], state
            return True
        if self._state is _State.CALL_ID:
            cut = pending.find(m.argument_begin)
            if cut < 0:
                return False  # ids are short: wait for the whole id
            call_id = pending[:cut].strip() or f"functions.unknown:{self._index}"
            out.append(ToolCallHeader(self._index, call_id, function_name(call_id)))
            self._pending, self._state = pending[cut + len(m.argument_begin):], _State.ARGUMENTS
            return True
        cut = pending.find(m.call_end)
        if cut < 0:
            return self._release(out, lambda text: ToolCallArguments(self._index, text), (m.call_end,))
        _emit(out, ToolCallArguments(self._index, pending[:cut]))
        self._pending, self._state = pending[cut + len(m.call_end):], _State.SECTION
        self._index += 1
        self.completed_calls += 1
        return True

    def _release(self, out: list[ToolCallEvent], make: Callable[[str], ToolCallEvent],
                 markers: tuple[str, ...]) -> bool:
        """Emit the pending text except a tail that may grow into one of ``markers``; then wait."""
        hold = partial_suffix_len(self._pending, markers)
        text = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        if text:
            out.append(make(text))
        return False


def _emit(out: list[ToolCallEvent], event: ContentText | ToolCallArguments) -> None:
    if event.text:
        out.append(event)
