"""What markup a served model's replies use: reasoning tags, tool-call markers, or neither."""

from __future__ import annotations

from dataclasses import dataclass, replace

from crescent.services.gateway.reasoning import THINK_TAGS, ReasoningTags
from crescent.services.gateway.tool_calls import KIMI_TOOL_CALL_MARKERS, ToolCallMarkers


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """``None`` means the model has no such channel; a model with tool-call markers accepts ``tools``."""

    reasoning: ReasoningTags | None = None
    tool_calls: ToolCallMarkers | None = None

    @property
    def supports_tools(self) -> bool:
        return self.tool_calls is not None

    def without_tools(self) -> OutputFormat:
        return replace(self, tool_calls=None)


PLAIN_OUTPUT = OutputFormat()
KIMI_OUTPUT = OutputFormat(reasoning=THINK_TAGS, tool_calls=KIMI_TOOL_CALL_MARKERS)
