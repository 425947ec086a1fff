"""Tokenizer and chat template: the default model's GGUF vocabulary, plus tiny hand-made vocabularies."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from crescent.services.model.chat_template import ChatTemplate, ChatTemplateError
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from crescent.services.model.tokenizer import Tokenizer, TokenizerError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — naïve café, ½ ≠ ¼; Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji: 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "def f(x):\n\treturn x  # two  spaces\r\n\n\n   trailing   ",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model(DEFAULT_MODEL).path)


def test_special_tokens_match_the_model_card(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == tok.token_to_id("<|im_start|>") == 1
    assert tok.eos_token_ids == (2, 0)  # <|im_end|> first: it ends an assistant turn
    assert tok.token_to_id("<|endoftext|>") == 0


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "unicode", "emoji", "code", "empty"])
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_token_text_encodes_to_its_id_without_an_added_bos(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nHi there<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1 and 2 in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nHi there\n"
    assert tok.encode("Hi")[0] != 1  # no BOS prepended


def test_merges_are_applied_and_digits_split(tok: Tokenizer) -> None:
    # Without the merge table every byte would be its own token.
    assert len(tok.encode("Hello")) == 1 and len(tok.encode(" the")) == 1
    assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) <= 11
    # SmolLM's pre-tokenizer (llama.cpp "smollm") puts every digit in its own token.
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_incremental_detokenizer_streams_whole_characters(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>" + TEXTS[1] + TEXTS[2] + "<|im_end|>")
    detok = tok.new_detokenizer()
    chunks = [detok.push(i) for i in ids]
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks  # some tokens end mid-character and must wait for the rest
    assert not any("<|im" in c for c in chunks)


def test_chat_template_renders_chatml_with_generation_prompt(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The model's own template adds its default system prompt when none is given.
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert plain == f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(tok.apply_chat_template(messages))
    assert ids[0] == 1 and ids.count(1) == 5 and ids.count(2) == 4


def test_hf_files_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save_hf(tmp_path, model_max_length=8192)
    again = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + ["<|im_start|>assistant\n12345<|im_end|>"]:
        assert again.encode(text) == tok.encode(text)
    assert (again.eos_token_ids, again.bos_token_id, again.vocab_size) == (tok.eos_token_ids, 1, 49152)
    assert again.chat_template == tok.chat_template


# --- tiny hand-made vocabularies: the GGUF metadata alone, no tensors -------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "1 2"]


def write_vocab_gguf(path: Path, *, pre: str = "smollm", model: str = "gpt2", template: str | None = None) -> None:
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell", "hello", "Ġw", "12"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tokenizer_from_metadata_only_gguf(tmp_path: Path) -> None:
    path = tmp_path / "vocab-only.gguf"
    write_vocab_gguf(path)
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode("hello world")
    assert [tok.decode([i]) for i in ids] == ["hello", " w", "o", "r", "l", "d"]
    # The "1 2" merge exists, but the smollm pre-tokenizer splits digits first.
    assert len(tok.encode("12")) == 2
    assert tok.encode("<|im_end|>") == [2]
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1
    # No chat template in the file: ChatML.
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_gpt2_pre_tokenizer_keeps_digit_merges(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_vocab_gguf(path, pre="gpt2")
    assert len(Tokenizer.from_gguf(path).encode("12")) == 1


@pytest.mark.parametrize(
    ("pre", "model", "message"),
    [("mystery-pre", "gpt2", "tokenizer.ggml.pre 'mystery-pre'"), ("default", "llama", "tokenizer.ggml.model 'llama'")],
)
def test_unsupported_gguf_tokenizers_are_named(tmp_path: Path, pre: str, model: str, message: str) -> None:
    path = tmp_path / "bad.gguf"
    write_vocab_gguf(path, pre=pre, model=model)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf(path)


# --- chat template edge cases -----------------------------------------------------------------

def test_template_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversations must start with a user"):
        template.render([{"role": "assistant", "content": "no"}])


@pytest.mark.parametrize(
    ("source", "messages"),
    [
        ("{% for m in messages %}{{ m['content'] }}", [{"role": "user", "content": "x"}]),  # unclosed block
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}]),  # sandbox
        ("{{ messages[0]['content'] + '!' }}", [{"role": "user"}]),  # missing content
        ("{{ messages[0]['content'] }}", []),  # empty conversation
    ],
    ids=["syntax", "sandbox", "missing-content", "empty"],
)
def test_template_failures_are_chat_template_errors(source: str, messages: list[dict[str, str]]) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(messages)


def test_template_helpers_behave_like_transformers() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ eos_token }}",
        bos_token="<s>", eos_token="</s>",
    )
    out = template.render([{"role": "user", "content": "café"}])
    assert out == '<s>{"role": "user", "content": "café"}\n</s>'  # tojson keeps non-ASCII


def test_a_file_that_is_not_gguf_is_a_tokenizer_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="fake.gguf"):
        Tokenizer.from_gguf(path)
