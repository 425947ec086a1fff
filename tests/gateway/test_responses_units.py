"""The Responses pieces without a network: items to chat messages, reply events to output items."""

from __future__ import annotations

from crescent.services.gateway.parsing.assistant_output import ReasoningDelta, ToolCallDelta
from crescent.services.gateway.generation import TextDelta
from crescent.services.gateway.responses.api import ResponseRequest
from crescent.services.gateway.responses.input import Item, chat_messages
from crescent.services.gateway.responses.output import OutputBuilder


def items(*raw: dict[str, object]) -> list[Item]:
    return ResponseRequest.model_validate({"model": "m", "input": list(raw)}).input_items()


def test_calls_join_the_assistant_text_before_them_and_reasoning_joins_the_next_turn() -> None:
    messages = chat_messages(items(
        {"role": "user", "content": "q"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "looking"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dangling"}]},
        {"role": "developer", "content": "next"},
    ))
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "looking", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "developer", "content": "next"},  # reasoning no assistant turn follows is dropped
    ]


def test_each_change_of_channel_closes_the_open_item() -> None:
    builder = OutputBuilder()
    events = []
    for event in (ReasoningDelta("r"), TextDelta("a"), TextDelta("b"), ToolCallDelta(0, "c0", "f", ""),
                  ToolCallDelta(0, None, None, "{}"), TextDelta("after")):
        events += builder.push(event)
    events += builder.finish(cut=True)
    assert [item.type for item in builder.items] == ["reasoning", "message", "function_call", "message"]
    assert [item.status for item in builder.items] == ["completed", "completed", "completed", "incomplete"]
    assert builder.items[1].content[0].text == "ab"  # type: ignore[union-attr]
    assert builder.items[2].arguments == "{}"  # type: ignore[union-attr]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]


def test_a_reply_with_no_answer_still_has_a_message() -> None:
    builder = OutputBuilder()
    builder.push(ReasoningDelta("only thinking"))
    builder.finish(cut=False)
    assert [item.type for item in builder.items] == ["reasoning", "message"]
    assert builder.items[1].content[0].text == ""  # type: ignore[union-attr]
