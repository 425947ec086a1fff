"""Tools for models whose chat template has none: one default prompt, in the Hermes/Qwen style.

SmolLM2's ChatML template renders ``role`` and ``content`` and nothing else, so the gateway
writes tools into the conversation itself, in the format many small instruct models (Qwen2.5,
Hermes) were trained on, before the template renders it:

- the offered tools go into the system message: after the conversation's own system message
  and a blank line, or as a new first system message when it has none::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": "get_weather", "description": ..., "parameters": ...}}
      </tools>

      For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (one line of JSON per tool, as the client sent it);
- an assistant message's ``tool_calls`` become that markup in its content, one block per call
  after any text, each on its own line::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``tool`` messages (ChatML templates may not know the role) become a ``user`` turn; results
  in a row share one turn, each as ``<tool_response>\\nRESULT\\n</tool_response>``, in order.

Everything here is plain text, built before ``prompt`` marks client strings that hold control
tokens, so the usual protection covers tools, calls and results as well. ``json_tool_calls``
parses the model's replies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TOOL_PROMPT_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOL_PROMPT_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tool_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` (OpenAI tool definitions) to the model."""
    return TOOL_PROMPT_HEAD + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOL_PROMPT_TAIL


def call_markup(name: str, arguments: str) -> str:
    """One call as the model is asked to write it; ``arguments`` is OpenAI's JSON string."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        value = arguments  # not JSON: kept, as a string, so the markup itself stays valid JSON
    body = json.dumps({"name": name, "arguments": value}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _assistant(message: dict[str, Any]) -> dict[str, Any]:
    calls = [call_markup(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = message.get("content") or ""
    fields = {k: v for k, v in message.items() if k != "tool_calls"}
    fields["content"] = "\n".join([text, *calls] if text else calls)
    return fields


def _tool_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    content = "\n".join(f"<tool_response>\n{m.get('content') or ''}\n</tool_response>" for m in results)
    return {"role": "user", "content": content}


def with_default_tools(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation (the template's message dicts) rewritten for a template without tools.

    ``tools`` None or empty: nothing is offered (``tool_choice`` "none"), but earlier calls and
    their results are still rewritten, so the history reads the same to the model.
    """
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []  # tool messages in a row, waiting to become one user turn
    for message in messages:
        if message["role"] == "tool":
            results.append(message)
            continue
        if results:
            out.append(_tool_results(results))
            results = []
        out.append(_assistant(message) if message["role"] == "assistant" and message.get("tool_calls") else message)
    if results:
        out.append(_tool_results(results))
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            own = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{own}\n\n{prompt}" if own else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
