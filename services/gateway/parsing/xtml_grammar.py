"""Grammars for Kimi K3 replies: the reply's shape is its XTML channels (``xtml_output``).

A constrained K3 reply starts where the prompt left it (inside ``think`` when thinking is on,
inside ``response`` when off) and must still come out as channels the parser reads. So a
constraint is placed inside the channel it is about, with no reasoning before it (as a forced
tool call elsewhere starts with the call):

- a structured output (``json_schema``, ``json_object``, ``regex``, ``choice``) is the
  ``response`` channel's whole text::

      [<|close|>think<|sep|><|open|>response<|sep|>] BODY <|close|>response<|sep|><|close|>message<|sep|>

- a forced tool call is an empty ``response`` channel, then a ``tools`` channel whose calls
  hold their arguments as one ``json type="object"`` element validated against the tool's schema
  (a form of K3's format that the parser reads like per-argument elements).

A client's own Lark grammar (``structured_outputs.grammar``) is left as it is: it shapes the raw
reply, markup included.
"""

from __future__ import annotations

import json
from typing import Any

from crescent.protos.common_pb2 import Constraint
from crescent.services.model.grammar import JSON_LAYOUT


def _tag(name: str, closing: bool = False) -> str:
    return f"{'<|close|>' if closing else '<|open|>'} {json.dumps(name)} <|sep|>"


def _json_rule(schema: Any) -> str:
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_LAYOUT}
    return "%json " + json.dumps(schema, separators=(",", ":"))


def _lead(thinking: bool) -> str:
    """Close the think channel empty and open the response channel, when thinking is on."""
    return f"{_tag('think', True)} {_tag('response')} " if thinking else ""


def tool_call_grammar(tools: list[tuple[str, dict[str, Any]]], several: bool, thinking: bool) -> str:
    """``tools``: (name, parameters schema) of the callable functions."""
    rules = []
    for i, (name, parameters) in enumerate(tools):
        head = json.dumps('call tool="' + name.replace("&", "&amp;").replace('"', "&quot;") + '" index="')
        element = _tag('json type="object"')
        rules.append(f"fn{i}: <|open|> {head} /[0-9]{{1,3}}/ {json.dumps(chr(34))} <|sep|> {element} args{i} "
                     f"{_tag('json', True)}")
        rules.append(f"args{i}: {_json_rule(parameters)}")
    calls = "call+" if several else "call"
    return "\n".join([
        f"start: {_lead(thinking)}{_tag('response', True)} {_tag('tools')} {calls} {_tag('tools', True)} "
        f"{_tag('message', True)}",
        f"call: ({' | '.join(f'fn{i}' for i in range(len(tools)))}) {_tag('call', True)}",
        *rules,
    ])


def in_response_channel(constraint: Constraint, thinking: bool) -> Constraint:
    """``constraint`` as a grammar over the whole K3 reply, its text the response channel's."""
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        body = _json_rule(json.loads(constraint.json_schema))
    elif kind == "json_object":
        body = _json_rule({"type": "object"})
    elif kind == "regex":
        body = "/" + constraint.regex.replace("/", "\\/") + "/"
    elif kind == "choice":
        body = " | ".join(json.dumps(c) for c in constraint.choice.choices)
    else:
        return constraint
    return Constraint(grammar="\n".join([
        f"start: {_lead(thinking)}body {_tag('response', True)} {_tag('message', True)}",
        f"body: {body}",
    ]))
