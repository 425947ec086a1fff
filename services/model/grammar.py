"""What a structured-output constraint means to the grammar engine (llguidance), torch-free.

The gateway checks every constraint with ``check_constraint`` before placing a request, so an
unsupported schema feature is a 400 naming it, never a silent unconstrained run; the engines
compile the same ``grammar_text`` against their tokenizer (``services.engine.constraints``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import llguidance

from crescent.protos import common_pb2

log = logging.getLogger(__name__)


class ConstraintError(ValueError):
    """A constraint the grammar engine cannot compile; the message says which part."""


# JSON as json.dumps writes it: whitespace the model may not choose. With flexible whitespace a
# small model fills objects with blank lines until max_tokens, and each mask costs more.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Rust regex metacharacters; everything else in a choice is literal as it is.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _literal_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def grammar_text(constraint: common_pb2.Constraint) -> str | None:
    """The llguidance grammar of ``constraint``; None when it constrains nothing."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            schema: Any = json.loads(constraint.json_schema)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ConstraintError("a JSON schema must be an object or a boolean")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.json_schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema cannot be used: {exc}") from exc
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices:
            raise ConstraintError("a choice constraint needs at least one choice")
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({_literal_regex(c)})" for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)


def check_constraint(constraint: common_pb2.Constraint) -> None:
    """Raise ``ConstraintError`` naming what the grammar engine cannot do with ``constraint``."""
    grammar = grammar_text(constraint)
    if grammar is None:
        return
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(messages[0] if messages else "the constraint does not compile")
    for warning in messages:
        log.info("constraint warning: %s", warning)


