"""``token_bytes``: each token's raw bytes (what logprobs report), on both tokenizer families.

What a client would notice: concatenating the bytes of a reply's tokens gives the reply's UTF-8
exactly (a character split over tokens included), and a token's text shown alone is its bytes
decoded on their own.
"""

from __future__ import annotations

import pytest
from crescent.services.model.kimi_tokenizer import load_kimi_tokenizer, tokenizer_for
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model

TEXT = "Héllo wörld — 日本語 🙂 𓂀 ꙮ\n\tdef f(x): return x"


@pytest.fixture(scope="module", params=["smollm2", "kimi"])
def tokenizer(request: pytest.FixtureRequest):
    return tokenizer_for(resolve_model(DEFAULT_MODEL)) if request.param == "smollm2" else load_kimi_tokenizer()


def test_the_bytes_of_a_replys_tokens_are_its_utf8(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    raw = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(raw) == TEXT.encode()
    assert any(b.decode("utf-8", errors="replace") != b.decode("utf-8", errors="ignore") for b in raw), \
        "the text should split a character over tokens"


def test_a_single_token_decodes_to_its_own_bytes(tokenizer) -> None:
    for token_id in range(0, tokenizer.vocab_size, max(tokenizer.vocab_size // 3000, 1)):
        raw = tokenizer.token_bytes(token_id)
        assert raw.decode("utf-8", errors="replace") == tokenizer.decode([token_id], skip_special_tokens=False)


def test_control_tokens_are_their_text(tokenizer) -> None:
    end = tokenizer.eos_token_ids[0]
    assert tokenizer.token_bytes(end) == tokenizer.decode([end], skip_special_tokens=False).encode()
    assert tokenizer.token_bytes(end).startswith(b"<|") or tokenizer.token_bytes(end).startswith(b"[")
