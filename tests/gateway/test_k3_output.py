"""Round trips through Kimi K3's format: render a conversation, take the assistant turn's text as the
model would write it, parse it back (token by token and whole), get the same message. K2's format
round-trips through its own parsers the same way. Uses the real Kimi vocabulary (../shared/)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from crescent.services.gateway.parsing.assistant_output import AssistantOutputParser, ReasoningDelta, ToolCallDelta
from crescent.services.gateway.generation import TextDelta
from crescent.services.gateway.parsing.output_format import K3_OUTPUT, KIMI_OUTPUT, OutputFormat
from crescent.services.model.kimi_tokenizer import KimiTokenizer, tokenizer_for
from crescent.services.model.literal_text import CLOSE, OPEN
from crescent.services.model.model_source import ModelSource, resolve_model
from tests.model.kimi_vocab import SHARED, needs_vocabulary

pytestmark = needs_vocabulary

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Oslo?"}]
ANSWER = {"role": "assistant", "content": "Let me check both.", "reasoning_content": "Two cities, so two calls.",
          "tool_calls": [
              {"id": "functions.get_weather:0", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris <3", "days": 2}'}},
              {"id": "functions.get_weather:1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "alerts": [true, null]}'}}]}


@pytest.fixture(scope="module")
def k3() -> KimiTokenizer:
    return tokenizer_for(resolve_model("kimi-k3-nano"))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def k2() -> KimiTokenizer:
    return KimiTokenizer.from_dir(SHARED)


def plain(text: str) -> str:
    return text.replace(OPEN, "").replace(CLOSE, "")


def model_side_text(tok: KimiTokenizer, question: list[dict], answer: dict, **variables: Any) -> str:
    """What the model writes for ``answer``: the full conversation's text past the prompt, less the
    end-of-turn token it stops with."""
    prompt = plain(tok.apply_chat_template(question, **variables))
    full = plain(tok.apply_chat_template([*question, answer], add_generation_prompt=False, **variables))
    assert full.startswith(prompt)
    end = "<|end_of_msg|>" if tok.chat_format == "k3" else "<|im_end|>"
    assert full.endswith(end)
    return full[len(prompt):-len(end)]


def parse_back(tok: KimiTokenizer, text: str, fmt: OutputFormat, *, streaming: bool) -> dict[str, Any]:
    parser = AssistantOutputParser(fmt)
    events = []
    if streaming:  # the model's tokens, one at a time, through the detokenizer as the gateway sees them
        detokenizer = tok.new_detokenizer()
        for token in tok.encode(text):
            events += parser.push(detokenizer.push(token))
    else:
        events += parser.push(text)
    events += parser.finish()
    calls: dict[int, dict[str, str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            call = calls.setdefault(e.index, {"name": "", "arguments": ""})
            call["name"] = e.name or call["name"]
            call["arguments"] += e.arguments
    return {
        "reasoning_content": "".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None,
        "content": "".join(e.text for e in events if isinstance(e, TextDelta)) or None,
        "tool_calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
        "completed": parser.completed_tool_calls,
    }


def expected(answer: dict, *, reasoning: bool = True) -> dict[str, Any]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.get("tool_calls", ())]
    return {"reasoning_content": answer.get("reasoning_content") if reasoning else None,
            "content": answer.get("content") or None, "tool_calls": calls, "completed": len(calls)}


@pytest.mark.parametrize("streaming", [True, False])
def test_k3_reasoning_answer_and_calls_round_trip(k3: KimiTokenizer, streaming: bool) -> None:
    text = model_side_text(k3, QUESTION, ANSWER)
    assert text.startswith("Two cities, so two calls.<|close|>think<|sep|>")
    assert parse_back(k3, text, K3_OUTPUT, streaming=streaming) == expected(ANSWER)


@pytest.mark.parametrize("streaming", [True, False])
def test_k3_instant_replies_round_trip_without_a_think_channel(k3: KimiTokenizer, streaming: bool) -> None:
    answer = {**ANSWER, "reasoning_content": None}
    text = model_side_text(k3, QUESTION, answer, thinking=False)
    assert "think" not in text
    fmt = K3_OUTPUT.for_thinking(False)
    assert parse_back(k3, text, fmt, streaming=streaming) == expected(answer, reasoning=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_k3_plain_answers_and_empty_reasoning_round_trip(k3: KimiTokenizer, streaming: bool) -> None:
    answer = {"role": "assistant", "content": "It is <b>sunny</b> & warm."}
    text = model_side_text(k3, QUESTION, answer)
    assert parse_back(k3, text, K3_OUTPUT, streaming=streaming) == expected(answer, reasoning=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_k2_format_round_trips_through_its_own_parsers(k2: KimiTokenizer, streaming: bool) -> None:
    text = model_side_text(k2, QUESTION, ANSWER, preserve_thinking=True)
    assert text.startswith("<think>Two cities")
    assert parse_back(k2, text, KIMI_OUTPUT, streaming=streaming) == expected(ANSWER)


def test_calls_are_dropped_when_no_tools_were_offered_and_text_outside_channels_is_content() -> None:
    text = ("why<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|open|>tools<|sep|>"
            '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')
    parser = AssistantOutputParser(K3_OUTPUT.without_tools())
    events = parser.push(text) + parser.finish()
    assert events == [ReasoningDelta("why"), TextDelta("Hi")] and parser.completed_tool_calls == 0
    parser = AssistantOutputParser(K3_OUTPUT)
    events = parser.push("why<|close|>think<|sep|>stray answer<|close|>message<|sep|>ignored") + parser.finish()
    assert events == [ReasoningDelta("why"), TextDelta("stray answer")]


def test_a_reply_cut_short_keeps_what_it_had() -> None:
    parser = AssistantOutputParser(K3_OUTPUT)
    assert parser.push("still thinking <|clo") == [ReasoningDelta("still thinking ")]
    assert parser.finish() == [ReasoningDelta("<|clo")]
    parser = AssistantOutputParser(K3_OUTPUT.for_thinking(False))
    events = parser.push('ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a&quot;b" index="1"<|sep|>'
                         '<|open|>json type="object"<|sep|>{"x": 1}<|close|>json<|sep|>')
    events += parser.finish()
    assert events == [TextDelta("ok"), ToolCallDelta(0, 'functions.a"b:0', 'a"b', ""),
                      ToolCallDelta(0, None, None, '{"x": 1}')]
    assert parser.completed_tool_calls == 0  # the call never closed


def test_a_repeated_opening_of_the_first_channel_is_not_text() -> None:
    parser = AssistantOutputParser(K3_OUTPUT)
    events = parser.push("<|open|>think<|sep|>hm<|close|>think<|sep|><|open|>response<|sep|>A") + parser.finish()
    assert events == [ReasoningDelta("hm"), TextDelta("A")]


def test_a_k3_checkpoint_and_the_preset_render_alike(tmp_path, k3: KimiTokenizer) -> None:  # noqa: ANN001
    from tests.model.kimi_vocab import write_k3_checkpoint

    tok = tokenizer_for(ModelSource(kind="hf", path=write_k3_checkpoint(tmp_path / "k3"), model_id="k3"))
    assert tok.encode(tok.apply_chat_template([*QUESTION, ANSWER])) == k3.encode(
        k3.apply_chat_template([*QUESTION, ANSWER]))
