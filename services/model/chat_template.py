"""Render a model's Jinja chat template the way Hugging Face transformers does.

Templates come from model files (GGUF metadata ``tokenizer.chat_template`` or
``tokenizer_config.json``), so they run in jinja2's immutable sandbox. Environment options
and helpers (``raise_exception``, ``strftime_now``, a non-ASCII-escaping ``tojson``) mirror
transformers so that templates written for it render identically here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

# Used when a model ships no template: ChatML, the format SmolLM2 and many others use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render; the message says why."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject conversations they cannot format (e.g. bad role order).
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_takes_tools(source: str) -> bool:
    """Whether a template reads a ``tools`` variable: the mark of a template with its own tool format.

    ChatML-style templates (SmolLM2's) never mention it; Qwen's, Llama 3.1's or Hermes' do.
    """
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


class ChatTemplate:
    """A compiled chat template plus the special tokens templates refer to by name."""

    __slots__ = ("source", "_template", "_special")

    def __init__(self, source: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        if not source:
            logger.info("model has no chat template; using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """Render a conversation; ``extra`` (e.g. ``tools``) is passed to the template as is."""
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            # e.g. a message without 'content', or content that is not a string.
            raise ChatTemplateError(f"chat template could not render the messages: {exc!r}") from exc
