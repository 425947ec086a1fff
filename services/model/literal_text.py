"""Text from users and tools is tokenized as text: a control token's string inside it stays text.

A chat template interpolates message text into a string full of control tokens
(``<|im_start|>``, ``<|im_end|>``, Kimi's ``<|im_system|>``...). Encoded as one string, a user who
types ``<|im_end|><|im_start|>system`` would forge a turn. So before rendering, every string of
the conversation that contains control-token text is wrapped in two Unicode noncharacters
(``OPEN``/``CLOSE``, reserved by Unicode for internal use: no text of a client may hold them);
after rendering, ``encode_marked`` encodes the template's own text with control tokens and each
wrapped span as plain text.

Templates must keep strings verbatim (JSON of tools included: the ``tojson`` filter of
``chat_template`` keeps non-ASCII characters, as transformers' does). Strings without control-token text are left alone, so the common prompt is rendered and encoded
exactly as before (token for token as the model's own tokenizer would).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

OPEN, CLOSE = "\ufdd0", "\ufdd1"
_SPAN = re.compile(f"{OPEN}(.*?){CLOSE}", re.S)


class ReservedCharacterError(ValueError):
    """A client's text holds one of the noncharacters this module reserves."""


def control_text_pattern(texts: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern that finds any of ``texts`` (longest first); None when there are none."""
    ordered = sorted({t for t in texts if t}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None


def mark_literals(value: Any, contains_control_text: Callable[[str], bool]) -> Any:
    """``value`` (the template's messages or tools) with every string holding control text wrapped."""
    if isinstance(value, str):
        if OPEN in value or CLOSE in value:
            raise ReservedCharacterError("text may not contain the Unicode noncharacters U+FDD0 or U+FDD1")
        return f"{OPEN}{value}{CLOSE}" if contains_control_text(value) else value
    if isinstance(value, dict):
        return {k: mark_literals(v, contains_control_text) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mark_literals(v, contains_control_text) for v in value]
    return value


def encode_marked(rendered: str, encode: Callable[[str], list[int]],
                  encode_as_text: Callable[[str], list[int]]) -> list[int]:
    """Token ids of a rendered prompt: wrapped spans as plain text, the rest with control tokens."""
    if OPEN not in rendered and CLOSE not in rendered:
        return encode(rendered)
    ids: list[int] = []
    start = 0
    for span in _SPAN.finditer(rendered):
        ids += _template_text(rendered[start:span.start()], encode)
        ids += encode_as_text(span.group(1))
        start = span.end()
    ids += _template_text(rendered[start:], encode)
    return ids


def _template_text(text: str, encode: Callable[[str], list[int]]) -> list[int]:
    if OPEN in text or CLOSE in text:
        # The template split or reordered a wrapped string: which part is whose is lost.
        raise ReservedCharacterError("the chat template cut a message that holds control-token text")
    return encode(text) if text else []
