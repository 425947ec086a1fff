"""Split a reply's streamed text into reasoning and content at ``<think>``…``</think>``.

Reasoning models open their reply with ``<think>``, reason, close with ``</think>`` and then
answer. Text arrives in arbitrary pieces (a tag may span several tokens), so a tail that may
still grow into a tag is held back until the next piece decides it. Only a ``<think>`` at the
very start of the reply (after optional whitespace) opens reasoning; anywhere else the tags
are ordinary text. A reply cut short inside reasoning leaves everything as reasoning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

Channel = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    start: str
    end: str


THINK_TAGS = ReasoningTags("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class Piece:
    channel: Channel
    text: str


def partial_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class _State(Enum):
    UNDECIDED = 1  # nothing but whitespace and maybe the start of the opening tag so far
    REASONING = 2
    CONTENT = 3


class ReasoningParser:
    """Feed text with ``push``; at the end call ``finish`` for what was held back."""

    def __init__(self, tags: ReasoningTags = THINK_TAGS) -> None:
        self._tags = tags
        self._state = _State.UNDECIDED
        self._pending = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def push(self, text: str) -> list[Piece]:
        """Add text; return the pieces that can be sent now, in order."""
        self._pending += text
        out: list[Piece] = []
        if self._state is _State.UNDECIDED:
            stripped = self._pending.lstrip()
            if stripped.startswith(self._tags.start):
                self._state = _State.REASONING
                self._pending = stripped[len(self._tags.start):]
            elif self._tags.start.startswith(stripped):
                return out  # still could be the opening tag
            else:
                self._state = _State.CONTENT
        if self._state is _State.REASONING:
            cut = self._pending.find(self._tags.end)
            if cut < 0:
                hold = partial_suffix_len(self._pending, (self._tags.end,))
                _append(out, "reasoning", self._pending[: len(self._pending) - hold])
                self._pending = self._pending[len(self._pending) - hold:]
                return out
            _append(out, "reasoning", self._pending[:cut])
            self._pending = self._pending[cut + len(self._tags.end):]
            self._state = _State.CONTENT
        _append(out, "content", self._pending)
        self._pending = ""
        return out

    def finish(self) -> list[Piece]:
        """The held-back tail, on the channel it was on (it never became a tag)."""
        tail, self._pending = self._pending, ""
        out: list[Piece] = []
        _append(out, "reasoning" if self._state is _State.REASONING else "content", tail)
        return out


def _append(out: list[Piece], channel: Channel, text: str) -> None:
    if text:
        out.append(Piece(channel, text))
