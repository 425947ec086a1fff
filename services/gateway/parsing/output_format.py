"""What markup a served model's replies use: reasoning tags, tool-call markers, or neither.

Tools reach a model one of two ways: its own chat template renders them (Kimi's), or, for a
template without tool support, the gateway writes them into the conversation itself in the
default format (``default_tools``) and parses replies with ``json_tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from crescent.services.gateway.parsing.json_tool_calls import HERMES_TOOL_CALL_TAGS, JsonToolCallTags
from crescent.services.gateway.parsing.reasoning import THINK_TAGS, ReasoningTags
from crescent.services.gateway.parsing.tool_calls import KIMI_TOOL_CALL_MARKERS, ToolCallMarkers


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """``None`` means the model has no such channel; a model with tool-call markup accepts ``tools``.

    ``gateway_renders_tools``: the gateway writes tool definitions, calls and results into the
    messages (``default_tools``); otherwise the tokenizer's template takes them (``tools=``).
    """

    reasoning: ReasoningTags | None = None
    tool_calls: ToolCallMarkers | JsonToolCallTags | None = None
    gateway_renders_tools: bool = False
    # Kimi K3's XTML channels (``xtml_output``): reasoning, content and calls in one markup.
    xtml: bool = False
    xtml_tools: bool = True       # False: the request offered no tools, calls are dropped
    xtml_thinking: bool = True    # the reply starts inside the think channel (thinking on)

    @property
    def supports_tools(self) -> bool:
        return self.tool_calls is not None or (self.xtml and self.xtml_tools)

    def without_tools(self) -> OutputFormat:
        return replace(self, tool_calls=None, xtml_tools=False)

    def for_thinking(self, thinking: bool) -> OutputFormat:
        """The format of one reply: an XTML reply starts in the channel its prompt opened."""
        return replace(self, xtml_thinking=thinking) if self.xtml else self


PLAIN_OUTPUT = OutputFormat()
KIMI_OUTPUT = OutputFormat(reasoning=THINK_TAGS, tool_calls=KIMI_TOOL_CALL_MARKERS)
# Kimi K3: XTML channels (think, response, tools), rendered by kimi_k3_format.
K3_OUTPUT = OutputFormat(xtml=True)
# Models whose template has no tool support: the default tool prompt and <tool_call>{json}</tool_call>.
DEFAULT_TOOL_OUTPUT = OutputFormat(tool_calls=HERMES_TOOL_CALL_TAGS, gateway_renders_tools=True)
