"""A tiny deterministic tokenizer with the gateway's tokenizer interface, for tests.

Tokens are pairs of ASCII characters (single characters where a pair does not fit), so a stop
string can begin in the middle of one token and end in the middle of the next. Ids are
stable across processes: the fake backend decodes prompts with this same module. The chat
template is ChatML and, like real templates, refuses a system message that is not first.
Its vocabulary is every id below ``VOCAB_SIZE``. Text holding ``#tokenizer_bug`` makes ``encode``
raise ``RuntimeError``: an unhandled error in the gateway, for the tests of its 500s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from crescent.services.gateway.prompt import ServedModel

ENDOFTEXT, IM_START, IM_END = 0, 1, 2
SPECIALS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
_SINGLE, _PAIR, _WIDE = 3, 3 + 128, 3 + 128 + 128 * 128
VOCAB_SIZE = _WIDE + 0x110000  # every code point has an id; a surrogate's decodes as U+FFFD, as real ones would
MODEL_ID = "fake-model"


class FakeTemplateError(ValueError):
    pass


def _piece_ids(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        a = text[i]
        b = text[i + 1] if i + 1 < len(text) else ""
        if ord(a) < 128 and b and ord(b) < 128:
            ids.append(_PAIR + ord(a) * 128 + ord(b))
            i += 2
        else:
            ids.append(_SINGLE + ord(a) if ord(a) < 128 else _WIDE + ord(a))
            i += 1
    return ids


def token_text(token_id: int, *, specials: bool = False) -> str:
    if token_id in _SPECIAL_TEXT:
        return _SPECIAL_TEXT[token_id] if specials else ""
    if token_id >= _WIDE:
        code = token_id - _WIDE
        return "\ufffd" if 0xD800 <= code <= 0xDFFF else chr(code)
    if token_id >= _PAIR:
        a, b = divmod(token_id - _PAIR, 128)
        return chr(a) + chr(b)
    return chr(token_id - _SINGLE)


class FakeDetokenizer:
    def push(self, token_id: int) -> str:
        return token_text(token_id)


class FakeTokenizer:
    eos_token_ids = (IM_END, ENDOFTEXT)
    vocab_size = VOCAB_SIZE

    def contains_control_text(self, text: str) -> bool:
        return _SPLIT.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        return _piece_ids(text)

    def encode(self, text: str) -> list[int]:
        if "#tokenizer_bug" in text:
            raise RuntimeError("the fake tokenizer's simulated bug")
        ids: list[int] = []
        for part in _SPLIT.split(text):
            ids.extend([SPECIALS[part]] if part in SPECIALS else _piece_ids(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(i, specials=not skip_special_tokens) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **template_vars: object) -> str:
        parts = []
        for index, message in enumerate(messages):
            if message["role"] == "system" and index != 0:
                raise FakeTemplateError("a system message must come first")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        return token_text(token_id, specials=True).encode("utf-8")

    def new_detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer()


def fake_served_model(settings: object) -> ServedModel:
    """The gateway's ``model_loader`` hook for tests."""
    context_window = getattr(settings, "context_window", None) or 256
    return ServedModel(FakeTokenizer(), MODEL_ID, context_window, template_errors=(FakeTemplateError,))
