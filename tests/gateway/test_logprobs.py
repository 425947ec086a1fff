"""``logprobs`` / ``top_logprobs`` through the real gateway and the ``openai`` client.

The fake backend (``fake_backend.fake_logprob``) gives reply token ``i`` the log-probability
-(i + 1) / 8 and alternatives α, β, ... each 0.5 less likely, so a test can tell exactly which
token an entry belongs to: one entry per token the client receives, in order, none for the
end-of-turn token or for a token a stop string cut, none lost or repeated by a migration.
The fake tokenizer makes a token of every two ASCII characters.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from .fake_tokenizer import MODEL_ID, FakeTokenizer
from .support import FakeBackend, Gateway

TOKENIZER = FakeTokenizer()


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def pieces(text: str) -> list[str]:
    return [TOKENIZER.decode([t]) for t in TOKENIZER.encode(text)]


def expected_chat(tokens: list[str], top: int) -> list[dict[str, Any]]:
    """What ``choices[0].logprobs.content`` must hold for reply tokens ``tokens``."""
    out = []
    for i, token in enumerate(tokens):
        logprob = -(i + 1) / 8
        alternatives = [(token, logprob)] + [(chr(0x3B1 + j), logprob - j / 2) for j in range(1, top)]
        out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                     for t, lp in alternatives[:top]]})
    return out


def content_of(logprobs: Any) -> list[dict[str, Any]]:
    return [entry.model_dump() for entry in logprobs.content]


def streamed_chat(client: openai.OpenAI, content: str, **options: Any) -> tuple[str, list[Any], list[Any]]:
    """(text, every chunk's choice, the entries of all chunks in order)."""
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=user(content), stream=True,
                                                 logprobs=True, **options))
    choices = [c.choices[0] for c in chunks if c.choices]
    entries = [e for ch in choices if ch.logprobs is not None for e in content_of(ch.logprobs)]
    return "".join(ch.delta.content or "" for ch in choices), choices, entries


def test_chat_reports_every_reply_token_with_its_alternatives(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=user("hello wörld"), logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.message.content == "hello wörld"
    # The end-of-turn token counts in usage but adds no text: it has no entry.
    assert reply.usage is not None and reply.usage.completion_tokens == len(pieces("hello wörld")) + 1
    assert content_of(choice.logprobs) == expected_chat(pieces("hello wörld"), 2)
    assert [e.token for e in choice.logprobs.content] == ["he", "ll", "o ", "w", "ö", "rl", "d"]
    assert choice.logprobs.content[4].bytes == [0xC3, 0xB6]


def test_logprobs_without_top_logprobs_has_no_alternatives(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=user("hi thar"), logprobs=True)
    assert content_of(reply.choices[0].logprobs) == expected_chat(["hi", " t", "ha", "r"], 0)
    plain = client.chat.completions.create(model=model, messages=user("hi thar"))
    assert plain.choices[0].logprobs is None


def test_top_logprobs_needs_logprobs(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=user("hi"), top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=user("hi"), logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs"  # type: ignore[index]


def test_streamed_chunks_carry_the_entries_of_their_own_text(client: openai.OpenAI, backend: FakeBackend) -> None:
    text, choices, entries = streamed_chat(client, "#batch=3 streaming wurks fine", top_logprobs=3)
    assert text == "streaming wurks fine"
    assert entries == expected_chat(pieces(text), 3)
    for ch in choices:  # each content chunk holds exactly the entries of its text
        got = "".join(e.token for e in ch.logprobs.content) if ch.logprobs is not None else ""
        assert got == (ch.delta.content or "")
    assert choices[-1].finish_reason == "stop"
    prefill = [p for p in backend.get("/prefills") if "streaming wurks fine" in TOKENIZER.decode(p["token_ids"])][-1]
    assert (prefill["logprobs"], prefill["top_logprobs"]) == (True, 3)


@pytest.mark.parametrize(("stop", "text", "reported"), [
    ("o w", "hell", ["he", "ll"]),         # the stop string starts on a token boundary: "o " is cut
    ("lo", "hel", ["he", "ll"]),           # "ll" starts before the stop string: it keeps its entry
    ("wurld", "hello ", ["he", "ll", "o "]),
])
def test_a_token_cut_by_a_stop_string_has_no_entry(client: openai.OpenAI, model: str, stop: str, text: str,
                                                   reported: list[str]) -> None:
    reply = client.chat.completions.create(model=model, messages=user("hello wurld"), logprobs=True,
                                           top_logprobs=1, stop=stop)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (text, "stop")
    assert content_of(reply.choices[0].logprobs) == expected_chat(reported, 1)
    streamed_text, choices, entries = streamed_chat(client, "hello wurld", top_logprobs=1, stop=stop)
    assert streamed_text == text and entries == expected_chat(reported, 1)


def test_a_migrated_stream_continues_its_entries(client: openai.OpenAI, backend: FakeBackend) -> None:
    words = "w" + uuid.uuid4().hex[:11]
    # Every decode stream breaks after two events: the request is placed again five times.
    text, _, entries = streamed_chat(client, f"#loop #fail_after=2 {words}", top_logprobs=2, max_tokens=16)
    tokens = [TOKENIZER.decode([t]) for t in TOKENIZER.encode(words)] * 3
    assert text == "".join(tokens[:16])
    assert entries == expected_chat(tokens[:16], 2), "an entry was lost or repeated across a migration"
    migrated = [p for p in backend.get("/prefills") if words in TOKENIZER.decode(p["token_ids"])]
    assert len(migrated) >= 5 and all(p["logprobs"] and p["top_logprobs"] == 2 for p in migrated)


def test_a_migration_before_the_handoff_keeps_the_first_entries(client: openai.OpenAI) -> None:
    words = "h" + uuid.uuid4().hex[:9]
    reply = client.chat.completions.create(model=MODEL_ID, messages=user(f"#handoff_fail=1 {words}"),
                                           logprobs=True, top_logprobs=1)
    assert content_of(reply.choices[0].logprobs) == expected_chat(pieces(words), 1)


def expected_legacy(tokens: list[str], top: int) -> dict[str, Any]:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = []
    for i, token in enumerate(tokens):
        logprob = -(i + 1) / 8
        alternatives = {token: logprob} | {chr(0x3B1 + j): logprob - j / 2 for j in range(1, top)}
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [-(i + 1) / 8 for i in range(len(tokens))], "top_logprobs": tops,
            "text_offset": offsets}


def test_completions_report_the_legacy_shape(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="hello wurld", logprobs=3)
    assert reply.choices[0].text == "hello wurld"
    assert reply.choices[0].logprobs.model_dump() == expected_legacy(pieces("hello wurld"), 3)
    zero = client.completions.create(model=model, prompt="hello wurld", logprobs=0, stop="wur")
    assert zero.choices[0].text == "hello "
    assert zero.choices[0].logprobs.model_dump() == expected_legacy(["he", "ll", "o "], 1)  # the sampled token only


def test_streamed_completions_carry_offsets_into_the_whole_text(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(model=model, prompt=["#batch=2 one two thrii", "four fivv"],
                                            logprobs=2, stream=True))
    for index, text in ((0, "one two thrii"), (1, "four fivv")):
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        streamed = ""
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.index != index:
                    continue
                streamed += choice.text
                if choice.logprobs is not None:
                    assert "".join(choice.logprobs.tokens) == choice.text
                    for key in merged:
                        merged[key] += getattr(choice.logprobs, key)
        assert streamed == text
        assert merged == expected_legacy(pieces(text), 2)


def test_completions_refuse_logprobs_with_echo(gateway: Gateway) -> None:
    reply = httpx.post(f"{gateway.url}/v1/completions", timeout=10,
                       json={"model": MODEL_ID, "prompt": "hi", "logprobs": 1, "echo": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"
    reply = httpx.post(f"{gateway.url}/v1/completions", timeout=10,
                       json={"model": MODEL_ID, "prompt": "hi", "logprobs": 6})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"
