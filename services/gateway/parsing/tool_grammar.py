"""``tool_choice`` "required" or a named function: the reply is grammar-constrained to tool calls.

The grammar is written in the model's own call markup, so the usual parser turns the reply into
``tool_calls``, and each call's arguments follow that tool's JSON schema (llguidance's ``%json``):

- the default format (``default_tools``)::

      <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>

- Kimi's, with its special tokens::

      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

- Kimi K3's XTML channels (``xtml_grammar``)::

      <|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>
      <|open|>call tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>
      <|close|>call<|sep|>...<|close|>tools<|sep|><|close|>message<|sep|>

"required" allows one call of any offered tool, or several when ``parallel_tool_calls`` is not
false; a named function allows exactly one call of it. A forced reply starts with the call: no
text and no reasoning before it.
"""

from __future__ import annotations

import json
from typing import Any

from crescent.protos.common_pb2 import Constraint
from crescent.services.gateway.api_models import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from crescent.services.gateway.parsing.json_tool_calls import JsonToolCallTags
from crescent.services.gateway.parsing.output_format import OutputFormat
from crescent.services.gateway.parsing.tool_calls import ToolCallMarkers
from crescent.services.gateway.parsing.xtml_grammar import tool_call_grammar
from crescent.services.model.grammar import JSON_LAYOUT

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def _json_rule(schema: dict[str, Any]) -> str:
    # Inline JSON takes its layout from the schema's own x-guidance options, not the grammar's defaults.
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, separators=(",", ":"))


def _default_format_grammar(tags: JsonToolCallTags, tools: list[ToolDefinition], several: bool) -> str:
    rules = []
    for i, tool in enumerate(tools):
        call = {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"fn{i}: {_json_rule(call)}")
    calls = 'call ("\\n" call)*' if several else "call"
    return "\n".join([
        f"start: {calls}",
        f"call: {json.dumps(tags.begin + chr(10))} ({' | '.join(f'fn{i}' for i in range(len(tools)))}) "
        f"{json.dumps(chr(10) + tags.end)}",
        *rules,
    ])


def _kimi_grammar(markers: ToolCallMarkers, tools: list[ToolDefinition], several: bool) -> str:
    # The index numbers calls across the conversation; bounded, so a weak model cannot write digits forever.
    rules = [f"fn{i}: {json.dumps(f'functions.{tool.function.name}:')} /[0-9]{{1,3}}/ {markers.argument_begin} "
             f"args{i}\nargs{i}: {_json_rule(_parameters(tool))}" for i, tool in enumerate(tools)]
    calls = "call+" if several else "call"
    return "\n".join([
        f"start: {markers.section_begin} {calls} {markers.section_end}",
        f"call: {markers.call_begin} ({' | '.join(f'fn{i}' for i in range(len(tools)))}) {markers.call_end}",
        *rules,
    ])


def forced_tool_constraint(request: ChatCompletionRequest, fmt: OutputFormat) -> Constraint | None:
    """The constraint that forces a tool call, or None when ``tool_choice`` forces nothing."""
    choice = request.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    tools = request.all_tools()
    if not forced or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    several = choice == "required" and request.parallel_tool_calls is not False
    if isinstance(fmt.tool_calls, JsonToolCallTags):
        return Constraint(grammar=_default_format_grammar(fmt.tool_calls, tools, several))
    if isinstance(fmt.tool_calls, ToolCallMarkers):
        return Constraint(grammar=_kimi_grammar(fmt.tool_calls, tools, several))
    if fmt.xtml:
        thinking = request.thinking is None or request.thinking.type == "enabled"
        return Constraint(grammar=tool_call_grammar([(t.function.name, _parameters(t)) for t in tools], several,
                                                    thinking))
    return None
