"""The Kimi tokenizer (tiktoken vocabulary from ../shared/kimi-tokenizer/) and the Kimi chat format."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import regex
from crescent.services.model.chat_template import ChatTemplateError
from crescent.services.model.kimi_k2_format import DEFAULT_SYSTEM_PROMPT
from crescent.services.model.kimi_tokenizer import (
    PAT_STR,
    TOKENIZER_DIR_ENV,
    KimiTokenizer,
    tokenizer_for,
)
from crescent.services.model.model_source import ModelSource, resolve_model
from crescent.services.model.tokenizer import TokenizerError
from tests.model.kimi_vocab import SHARED, needs_vocabulary

pytestmark = needs_vocabulary

TEXTS = [
    "Hello, world! I'm Kimi; we'll see.",
    "Grüße aus Köln — naïve café, ½ ≠ ¼; Ελληνικά, русский, 日本語のテキスト, 한국어",
    "你好世界，今天天气很好。Kimi是月之暗面开发的。",
    "emoji: 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "def f(x):\n\treturn x  # two  spaces\r\n\n\n   trailing   ",
    "numbers 1234567 and CamelCaseWords HTTPServer",
    "",
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.from_dir(SHARED)


def test_special_tokens_match_the_table(tok: KimiTokenizer) -> None:
    table = json.loads((SHARED / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert tok.vocab_size == 163840
    for token_id, entry in table.items():
        assert tok.token_to_id(entry["content"]) == int(token_id)
        assert tok.encode(entry["content"]) == [int(token_id)]  # special text is one token
    assert tok.bos_token_id == 163584  # [BOS]
    assert tok.eos_token_ids == (163586, 163585)  # <|im_end|> ends a turn, [EOS] a document
    assert tok.token_to_id("<|reserved_token_163589|>") == 163589  # unnamed ids are reserved specials
    assert tok.token_to_id("Hello") == tok.encode("Hello")[0]
    assert tok.token_to_id("no such single token at all") is None


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "unicode", "chinese", "emoji", "code", "mixed", "empty"])
def test_encode_decode_round_trip(tok: KimiTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.new_detokenizer()
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces), "the detokenizer never emits half a character"


@pytest.mark.parametrize("text", TEXTS[:-1])
def test_pre_tokenizer_is_kimis_regex(tok: KimiTokenizer, text: str) -> None:
    # The `regex` module applies the same pattern independently (set intersection `&&` needs V1):
    # tiktoken must cut the text into exactly these pieces and merge within each one.
    pieces = regex.findall("(?V1)" + PAT_STR, text)
    assert "".join(pieces) == text
    assert tok.encode(text) == [i for piece in pieces for i in tok.encode(piece)]


def test_pre_tokenizer_splits_like_kimi(tok: KimiTokenizer) -> None:
    def pieces(text: str) -> list[str]:
        return [tok.decode([i]) for i in tok.encode(text)]

    assert "".join(pieces("1234567")) == "1234567" and all(len(p) <= 3 for p in pieces("1234567"))
    assert pieces("你好abc")[-1].endswith("abc") and "".join(pieces("你好abc")) == "你好abc"
    assert not any("你" in p and "a" in p for p in pieces("你好abc")), "Han runs never share a token with Latin"
    assert " I'm" in pieces("Hello I'm here")  # contractions stay with their word


def test_decode_drops_control_tokens_but_keeps_reasoning_and_tool_markers(tok: KimiTokenizer) -> None:
    text = "<|im_assistant|>assistant<|im_middle|><think>r</think>ok<|tool_calls_section_begin|><|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "assistant<think>r</think>ok<|tool_calls_section_begin|>"
    detok = tok.new_detokenizer()
    assert "".join(detok.push(i) for i in ids) == tok.decode(ids)


def test_a_character_split_over_tokens_comes_out_whole(tok: KimiTokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1, "this emoji is several byte tokens in the Kimi vocabulary"
    detok = tok.new_detokenizer()
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_very_long_runs_encode_quickly_and_round_trip(tok: KimiTokenizer) -> None:
    text = " " * 60_000 + "x" * 60_000 + "\n"
    start = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - start < 5
    assert tok.decode(ids) == text


def test_unknown_token_id_is_a_tokenizer_error(tok: KimiTokenizer) -> None:
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.new_detokenizer().push(tok.vocab_size + 5)


# --- chat format ----------------------------------------------------------------------------


def test_plain_conversation_renders_in_kimi_format(tok: KimiTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_middle|>")
    ids = tok.encode(tok.apply_chat_template(messages))
    assert ids[0] == tok.token_to_id("<|im_system|>") and ids[-1] == tok.token_to_id("<|im_middle|>")


def test_default_system_prompt_and_text_parts(tok: KimiTokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}])
    assert rendered == (f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
                        "<|im_user|>user<|im_middle|>ab<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_tools_calls_results_and_reasoning_render_in_kimi_k2_format(tok: KimiTokenizer) -> None:
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Earlier question"},
        {"role": "assistant", "content": "Earlier answer", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I need the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "sunny"},
    ]
    rendered = tok.apply_chat_template(messages, tools=[WEATHER_TOOL])
    declared = json.dumps([WEATHER_TOOL], separators=(",", ":"))
    assert rendered.startswith(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
                               f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>")
    # Reasoning of turns before the last user message is dropped; the current turn's is kept.
    assert "old thoughts" not in rendered
    assert "<|im_assistant|>assistant<|im_middle|><think></think>Earlier answer<|im_end|>" in rendered
    assert rendered.endswith(
        "<|im_assistant|>assistant<|im_middle|><think>I need the tool.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert "tool_declare" not in tok.apply_chat_template(messages)  # no tools, no declaration


def test_template_refuses_unknown_roles(tok: KimiTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


# --- choosing and loading ---------------------------------------------------------------------


def test_kimi_k3_nano_preset_gets_the_kimi_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKENIZER_DIR_ENV, str(SHARED))
    assert isinstance(tokenizer_for(resolve_model("kimi-k3-nano")), KimiTokenizer)
    monkeypatch.setenv(TOKENIZER_DIR_ENV, "/nonexistent/kimi")
    with pytest.raises(TokenizerError, match=TOKENIZER_DIR_ENV):
        tokenizer_for(resolve_model("kimi-k3-nano"))


def test_a_model_directory_with_its_own_vocabulary_uses_it(tmp_path: Path) -> None:
    for name in ("tiktoken.model", "tokenizer_config.json"):
        os.symlink(SHARED / name, tmp_path / name)
    source = ModelSource(kind="kimi_k3", path=tmp_path, model_id="m", tokenizer="kimi")
    assert tokenizer_for(source).encode("<|im_end|>") == [163586]
    assert isinstance(tokenizer_for(ModelSource(kind="hf", path=tmp_path, model_id="m")), KimiTokenizer)


def test_broken_files_are_tokenizer_errors(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("not-base64! 0\n")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tiktoken vocabulary"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 1\n")
    with pytest.raises(TokenizerError, match="added_tokens_decoder"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "2": {"content": "[BOS]"}, "3": {"content": "[EOS]"}, "4": {"content": "<|im_end|>"}}}))
    with pytest.raises(TokenizerError, match=re.escape("<|im_middle|> is missing")):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"999": {"content": "x"}}}))
    with pytest.raises(TokenizerError, match="outside"):
        KimiTokenizer.from_dir(tmp_path)
