"""Reasoning and tool-call parsing as pure units: every way of cutting the text gives the same result."""

from __future__ import annotations

import json
import random

import pytest
from crescent.services.gateway.parsing.assistant_output import (
    AssistantOutputParser,
    OutputEvent,
    ReasoningDelta,
    ToolCallDelta,
    final_finish_reason,
)
from crescent.services.gateway.generation import TextDelta
from crescent.services.gateway.parsing.output_format import KIMI_OUTPUT, PLAIN_OUTPUT, OutputFormat
from crescent.services.gateway.parsing.reasoning import Piece, ReasoningParser, partial_suffix_len
from crescent.services.gateway.parsing.tool_calls import (
    ContentText,
    ToolCallArguments,
    ToolCallEvent,
    ToolCallHeader,
    ToolCallParser,
    function_name,
)

SECTION = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
CALL = "<|tool_call_begin|>{}<|tool_call_argument_begin|>{}<|tool_call_end|>"


def cuttings(text: str, seed: int = 0) -> list[list[str]]:
    """The whole text, one character at a time, every single cut, and a few random cuttings."""
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def run_reasoning(chunks: list[str]) -> tuple[str, str, list[str]]:
    parser = ReasoningParser()
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.push(chunk)
    pieces += parser.finish()
    channels = [p.channel for p in pieces]
    reasoning = "".join(p.text for p in pieces if p.channel == "reasoning")
    content = "".join(p.text for p in pieces if p.channel == "content")
    return reasoning, content, channels


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>Paris is in France.</think>It is sunny.", "Paris is in France.", "It is sunny."),
    ("\n <think>a<b</think>", "a<b", ""),
    ("No reasoning here.", "", "No reasoning here."),
    ("Answer <think>not reasoning</think>", "", "Answer <think>not reasoning</think>"),
    ("<think>cut short by max_tokens </thi", "cut short by max_tokens </thi", ""),
    ("<thin", "", "<thin"),
    ("<think></think>direct", "", "direct"),
    ("<think>one</think>two</think>", "one", "two</think>"),
])
def test_reasoning_split_does_not_depend_on_how_text_arrives(text: str, reasoning: str, content: str) -> None:
    for chunks in cuttings(text):
        got_reasoning, got_content, channels = run_reasoning(chunks)
        assert (got_reasoning, got_content) == (reasoning, content), chunks
        # All reasoning comes before any content.
        assert channels == sorted(channels, key=lambda c: c == "content"), chunks


def test_reasoning_streams_before_the_closing_tag_arrives() -> None:
    parser = ReasoningParser()
    assert parser.push("<think>Let me") == [Piece("reasoning", "Let me")]
    assert parser.push(" think</") == [Piece("reasoning", " think")]  # "</" may be the closing tag
    assert parser.push("think>Done") == [Piece("content", "Done")]


def test_partial_suffix_len() -> None:
    assert partial_suffix_len("abc<|tool", ["<|tool_call_end|>"]) == 6
    assert partial_suffix_len("abc", ["<|tool_call_end|>"]) == 0
    assert partial_suffix_len("x</think>", ["</think>"]) == 0  # a whole marker is not a partial one


def run_tools(chunks: list[str]) -> tuple[str, list[tuple[str, str, str]], ToolCallParser]:
    parser = ToolCallParser()
    events: list[ToolCallEvent] = []
    for chunk in chunks:
        events += parser.push(chunk)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallHeader):
            assert e.index == len(calls), "calls are numbered in order"
            calls[e.index] = [e.call_id, e.name, ""]
        elif isinstance(e, ToolCallArguments):
            calls[e.index][2] += e.text  # a header always comes before its arguments
    return content, [tuple(c) for c in calls.values()], parser  # type: ignore[misc]


def test_two_tool_calls_after_text_whatever_the_cuts() -> None:
    text = "Let me check." + SECTION.format(
        CALL.format("functions.get_weather:0", '{"city": "Paris"}')
        + "\n" + CALL.format("functions.get_time:1", '{"tz": "Europe/Paris"}'))
    for chunks in cuttings(text):
        content, calls, parser = run_tools(chunks)
        assert content == "Let me check."
        assert calls == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                         ("functions.get_time:1", "get_time", '{"tz": "Europe/Paris"}')]
        assert parser.completed_calls == 2


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallParser()
    assert parser.push(SECTION.split("{}")[0] + "<|tool_call_begin|>functions.f:0") == []  # id may grow
    assert parser.push("<|tool_call_argument_begin|>{\"a\":") == [
        ToolCallHeader(0, "functions.f:0", "f"), ToolCallArguments(0, '{"a":')]
    assert parser.push(" 1}<|tool_call_e") == [ToolCallArguments(0, " 1}")]
    assert parser.push("nd|>") == []
    assert parser.completed_calls == 1


def test_a_call_cut_short_keeps_its_partial_arguments_but_does_not_count_as_complete() -> None:
    content, calls, parser = run_tools(["x" + SECTION.split("{}")[0] + CALL.format("functions.f:0", '{"a": 1}')[:-20]])
    assert content == "x"
    assert calls == [("functions.f:0", "f", '{"a":')]
    assert parser.completed_calls == 0
    # Cut inside the id: nothing can be said about the call.
    content, calls, _ = run_tools(["<|tool_calls_section_begin|><|tool_call_begin|>functions.g"])
    assert (content, calls) == ("", [])


def test_text_without_markers_is_content_and_stray_text_in_the_section_is_dropped() -> None:
    assert run_tools(["a <|tool", "_call_end|> b"])[0] == "a <|tool_call_end|> b"
    text = SECTION.format("oops " + CALL.format("functions.f:0", "{}")) + " bye"
    for chunks in cuttings(text):
        content, calls, _ = run_tools(chunks)
        assert content == " bye"
        assert calls == [("functions.f:0", "f", "{}")]


@pytest.mark.parametrize(("call_id", "name"), [
    ("functions.get_weather:0", "get_weather"), ("functions.a.b:12", "a.b"), ("search", "search"),
    ("functions.f", "f"), ("lookup:3", "lookup"),
])
def test_function_name_from_native_id(call_id: str, name: str) -> None:
    assert function_name(call_id) == name


def run_output(fmt: OutputFormat, chunks: list[str]) -> tuple[list[OutputEvent], AssistantOutputParser]:
    parser = AssistantOutputParser(fmt)
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.push(chunk)
    return events + parser.finish(), parser


def test_reasoning_then_tool_calls_in_one_reply() -> None:
    text = "<think>Weather needs a tool.</think>" + SECTION.format(CALL.format("functions.w:0", '{"c": "Oslo"}'))
    for chunks in cuttings(text):
        events, parser = run_output(KIMI_OUTPUT, chunks)
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "Weather needs a tool."
        assert not [e for e in events if isinstance(e, TextDelta)]
        calls = [e for e in events if isinstance(e, ToolCallDelta)]
        assert (calls[0].call_id, calls[0].name) == ("functions.w:0", "w")
        assert all(c.call_id is None and c.name is None for c in calls[1:])
        assert json.loads("".join(c.arguments for c in calls)) == {"c": "Oslo"}
        assert final_finish_reason("stop", parser.completed_tool_calls) == "tool_calls"
        assert final_finish_reason("length", parser.completed_tool_calls) == "length"


def test_tool_markup_is_plain_content_when_tools_are_off_and_plain_models_pass_everything() -> None:
    text = "<think>r</think>" + SECTION.format(CALL.format("functions.w:0", "{}"))
    events, parser = run_output(KIMI_OUTPUT.without_tools(), [text])
    assert events == [ReasoningDelta("r"), TextDelta(text[len("<think>r</think>"):])]
    assert final_finish_reason("stop", parser.completed_tool_calls) == "stop"
    events, _ = run_output(PLAIN_OUTPUT, list(text))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
