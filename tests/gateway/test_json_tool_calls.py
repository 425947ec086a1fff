"""The default tool format as pure units: its parser (every way of cutting the reply gives the same
result) and how it writes tools, calls and results into a conversation."""

from __future__ import annotations

import json
import re

import pytest
from crescent.services.gateway.parsing.assistant_output import AssistantOutputParser, OutputEvent, ToolCallDelta
from crescent.services.gateway.parsing.default_tools import TOOL_PROMPT_HEAD, TOOL_PROMPT_TAIL, with_default_tools
from crescent.services.gateway.generation import TextDelta
from crescent.services.gateway.parsing.json_tool_calls import JsonToolCallParser, ParsedCall, parse_call
from crescent.services.gateway.parsing.output_format import DEFAULT_TOOL_OUTPUT, KIMI_OUTPUT, OutputFormat
from crescent.services.gateway.parsing.tool_calls import ContentText, ToolCallArguments, ToolCallEvent, ToolCallHeader

from .test_output_parsers import cuttings

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OSLO = '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}</tool_call>'
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def run(chunks: list[str]) -> tuple[str, list[tuple[str, str]], JsonToolCallParser]:
    parser = JsonToolCallParser()
    events: list[ToolCallEvent] = []
    for chunk in chunks:
        events += parser.push(chunk)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallHeader):
            assert e.index == len(calls), "calls are numbered in order"
            assert CALL_ID.match(e.call_id), e.call_id
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArguments):
            calls[e.index][1] += e.text  # a header always comes before its arguments
    return content, [(name, args) for name, args in calls.values()], parser


@pytest.mark.parametrize(("text", "content", "calls"), [
    (PARIS, "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n" + PARIS, "Let me check.\n", [("get_weather", '{"city": "Paris"}')]),
    (PARIS + "\n" + OSLO + "\n", "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Oslo"}')]),
    (PARIS + "\n\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    ('<tool_call>{"name": "f", "parameters": {"a": [1, "é"]}}</tool_call>', "", [("f", '{"a": [1, "é"]}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ("No tools <tool here>, a < b.", "No tools <tool here>, a < b.", []),
])
def test_calls_and_content_do_not_depend_on_how_text_arrives(text: str, content: str,
                                                              calls: list[tuple[str, str]]) -> None:
    for chunks in cuttings(text):
        got_content, got_calls, parser = run(chunks)
        assert (got_content, got_calls) == (content, calls), chunks
        assert parser.completed_calls == len(calls)
        assert all(isinstance(json.loads(args), dict) for _, args in got_calls)


@pytest.mark.parametrize("bad", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',   # a brace short
    '<tool_call>{"arguments": {}}</tool_call>',                       # no name
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',      # arguments not an object
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',                # cut off before the closing tag
])
def test_what_is_not_a_call_stays_content_verbatim(bad: str) -> None:
    for chunks in cuttings("Hi " + bad + " bye"):
        content, calls, parser = run(chunks)
        assert (content, calls, parser.completed_calls) == ("Hi " + bad + " bye", [], 0), chunks


def test_a_malformed_call_does_not_hide_a_good_one_after_it() -> None:
    text = "<tool_call>{oops}</tool_call>" + OSLO
    for chunks in cuttings(text):
        content, calls, _ = run(chunks)
        assert content == "<tool_call>{oops}</tool_call>"
        assert calls == [("get_time", '{"tz": "Europe/Oslo"}')]


def test_text_streams_until_a_tag_may_begin_and_ids_are_fresh() -> None:
    parser = JsonToolCallParser()
    assert parser.push("Sure <tool") == [ContentText("Sure ")]  # "<tool" may grow into the tag
    assert parser.push('_call>{"name": "f", "argu') == []       # a call is held until it closes
    events = parser.push('ments": {}}</tool_call>')
    assert [type(e) for e in events] == [ToolCallHeader, ToolCallArguments]
    again = JsonToolCallParser().push('<tool_call>{"name": "f"}</tool_call>')
    assert events[0].call_id != again[0].call_id  # type: ignore[union-attr]


def test_parse_call_keeps_unicode_and_rejects_an_empty_name() -> None:
    assert parse_call('{"name": "f", "arguments": {"q": "日本"}}') == ParsedCall("f", '{"q": "日本"}')
    assert parse_call('{"name": "", "arguments": {}}') is None


def output(fmt: OutputFormat, chunks: list[str], *, parallel: bool) -> tuple[list[OutputEvent], int]:
    parser = AssistantOutputParser(fmt, parallel_tool_calls=parallel)
    events: list[OutputEvent] = []
    for chunk in chunks:
        events += parser.push(chunk)
    return events + parser.finish(), parser.completed_tool_calls


def test_parallel_tool_calls_false_keeps_only_the_first_call_on_both_formats() -> None:
    kimi_call = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
    kimi = ("<|tool_calls_section_begin|>" + kimi_call.format("a", 0) + kimi_call.format("b", 1)
            + "<|tool_calls_section_end|>")
    for fmt, text in ((DEFAULT_TOOL_OUTPUT, PARIS + "\n" + OSLO), (KIMI_OUTPUT, kimi)):
        for chunks in cuttings(text):
            events, completed = output(fmt, chunks, parallel=False)
            calls = [e for e in events if isinstance(e, ToolCallDelta)]
            assert {c.index for c in calls} == {0} and completed == 1, chunks
            assert not [e for e in events if isinstance(e, TextDelta)]
        assert output(fmt, [text], parallel=True)[1] == 2


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_JSON = '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'
PROMPT = TOOL_PROMPT_HEAD + "\n" + TOOL_JSON + TOOL_PROMPT_TAIL


def test_the_tool_prompt_joins_the_system_message_or_becomes_one() -> None:
    assert with_default_tools([{"role": "user", "content": "hi"}], [TOOL]) == [
        {"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
    assert with_default_tools([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
                              [TOOL])[0] == {"role": "system", "content": "Be terse.\n\n" + PROMPT}
    assert PROMPT.startswith("# Tools\n") and PROMPT.endswith("</tool_call>")


def test_calls_and_results_are_written_as_markup_with_or_without_tools_offered() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris.", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    ]
    expected = [
        history[0],
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "not json"}'
                                         "\n</tool_call>"},
        {"role": "user",
         "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"},
        {"role": "assistant", "content": 'Sunny in Paris.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
    ]
    assert with_default_tools(history, None) == expected
    assert with_default_tools(history, [TOOL]) == [{"role": "system", "content": PROMPT}, *expected]


def test_only_templates_that_never_read_tools_get_the_default_format() -> None:
    from crescent.services.model.chat_template import CHATML_TEMPLATE, template_takes_tools

    assert not template_takes_tools(CHATML_TEMPLATE)
    assert template_takes_tools("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}")
