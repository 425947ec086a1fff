"""A fake model that reasons and calls tools in Kimi's markup, served by the real gateway process.

Its tokenizer is the fake one (pairs of characters, so every ``<think>`` or
``<|tool_call_begin|>`` in a reply arrives split over several tokens), with a chat template
that also renders tool definitions, tool calls and tool results, and its output format is
Kimi's. The fake backend echoes the last user message, so a test scripts a reply by sending it.

``python -m tests.gateway.fake_tool_model CONFIG`` runs the gateway with this model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from crescent.services.gateway.parsing.output_format import KIMI_OUTPUT
from crescent.services.gateway.prompt import ServedModel
from crescent.services.gateway.server import main

from .fake_tokenizer import FakeTemplateError, FakeTokenizer

TOOL_MODEL_ID = "fake-tool-model"


class FakeToolTokenizer(FakeTokenizer):
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_vars: Any) -> str:
        parts = [f"<|im_start|>tools\n{json.dumps(tools, ensure_ascii=False)}<|im_end|>\n"] if tools else []
        for message in messages:
            body = message["content"] or ""
            if message.get("reasoning_content"):
                body = f"<think>{message['reasoning_content']}</think>{body}"
            for call in message.get("tool_calls") or ():
                body += f"<call {call['id']} {call['function']['name']} {call['function']['arguments']}>"
            if message["role"] == "tool":
                if not message.get("tool_call_id"):
                    raise FakeTemplateError("a tool result needs its tool_call_id")
                body = f"result of {message['tool_call_id']}: {body}"
            parts.append(f"<|im_start|>{message['role']}\n{body}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def fake_tool_served_model(settings: object) -> ServedModel:
    """The gateway's ``model_loader`` hook: the fake tokenizer with tools and Kimi's output format."""
    context_window = getattr(settings, "context_window", None) or 4096
    return ServedModel(FakeToolTokenizer(), TOOL_MODEL_ID, context_window, template_errors=(FakeTemplateError,),
                       output_format=KIMI_OUTPUT)


if __name__ == "__main__":
    main(Path(sys.argv[1]), model_loader=fake_tool_served_model)
