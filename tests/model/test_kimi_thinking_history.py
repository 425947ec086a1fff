"""Thinking history: K3 keeps the reasoning of every earlier assistant turn in the prompt (in its
XTML think channel), K2-style Kimi models keep only the current turn's. Rendered with the real Kimi
tokenizer (../shared/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.parsing.output_format import KIMI_OUTPUT
from crescent.services.gateway.prompt import ServedModel, build_prompt
from crescent.services.model.literal_text import CLOSE, OPEN
from crescent.services.model.kimi_k2_format import DEFAULT_SYSTEM_PROMPT
from crescent.services.model.kimi_tokenizer import (
    TOKENIZER_DIR_ENV,
    KimiTokenizer,
    tokenizer_for,
)
from crescent.services.model.model_source import ModelSource, resolve_model
from crescent.services.model.tokenizer import TokenizerError
from tests.model.kimi_vocab import SHARED, needs_vocabulary

pytestmark = needs_vocabulary

SYSTEM = f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
# Two finished turns with reasoning, then a third question.
CONVERSATION = [
    {"role": "user", "content": "What is 17 * 3?"},
    {"role": "assistant", "content": "51.", "reasoning_content": "17 * 3 = 51."},
    {"role": "user", "content": "And plus 9?"},
    {"role": "assistant", "content": "60.", "reasoning_content": "51 + 9 = 60."},
    {"role": "user", "content": "Thanks!"},
]


def _family_dir(tmp_path: Path, model_type: str) -> ModelSource:
    """A model directory of the given family that ships the Kimi vocabulary."""
    for name in ("tiktoken.model", "tokenizer_config.json"):
        os.symlink(SHARED / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return ModelSource(kind="hf", path=tmp_path, model_id=model_type)


@pytest.fixture
def k3(monkeypatch: pytest.MonkeyPatch) -> KimiTokenizer:
    monkeypatch.setenv(TOKENIZER_DIR_ENV, str(SHARED))
    tok = tokenizer_for(resolve_model("kimi-k3-nano"))
    assert isinstance(tok, KimiTokenizer)
    return tok


@pytest.fixture
def k2(tmp_path: Path) -> KimiTokenizer:
    tok = tokenizer_for(_family_dir(tmp_path, "kimi_linear"))
    assert isinstance(tok, KimiTokenizer)
    return tok


def _xtml_turn(role: str, body: str) -> str:
    return f'<|open|>message role="{role}"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'


def test_k3_keeps_the_reasoning_of_every_earlier_turn(k3: KimiTokenizer) -> None:
    assert k3.thinking_history == "all" and k3.chat_format == "k3"
    effort = ('<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to '
              "think in your thinking channel (not including the response channel), supported values include `low`, "
              "`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`."
              "<|close|>message<|sep|><|end_of_msg|>")
    rendered = k3.apply_chat_template(CONVERSATION)
    assert rendered.replace(OPEN, "").replace(CLOSE, "") == (
        effort
        + _xtml_turn("user", "What is 17 * 3?")
        + _xtml_turn("assistant", "<|open|>think<|sep|>17 * 3 = 51.<|close|>think<|sep|>"
                                  "<|open|>response<|sep|>51.<|close|>response<|sep|>")
        + _xtml_turn("user", "And plus 9?")
        + _xtml_turn("assistant", "<|open|>think<|sep|>51 + 9 = 60.<|close|>think<|sep|>"
                                  "<|open|>response<|sep|>60.<|close|>response<|sep|>")
        + _xtml_turn("user", "Thanks!")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_k2_style_models_drop_reasoning_before_the_last_user_message(k2: KimiTokenizer) -> None:
    assert k2.thinking_history == "current_turn"
    assert k2.apply_chat_template(CONVERSATION) == (
        SYSTEM
        + "<|im_user|>user<|im_middle|>What is 17 * 3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>51.<|im_end|>"
        "<|im_user|>user<|im_middle|>And plus 9?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>60.<|im_end|>"
        "<|im_user|>user<|im_middle|>Thanks!<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    # the current agentic loop (after the last user message) keeps its reasoning in both families
    loop = CONVERSATION[:3] + [{"role": "assistant", "content": "Let me check.", "reasoning_content": "use a tool"}]
    assert "<think>use a tool</think>Let me check." in k2.apply_chat_template(loop)


@pytest.mark.parametrize("model_type,history", [("kimi_k3", "all"), ("kimi_linear", "current_turn"),
                                                 ("kimi_k2", "current_turn"), ("deepseek_v3", "current_turn"),
                                                 ("something_new", "current_turn")])
def test_the_family_comes_from_config_model_type(tmp_path: Path, model_type: str, history: str) -> None:
    tok = tokenizer_for(_family_dir(tmp_path, model_type))
    assert isinstance(tok, KimiTokenizer) and tok.thinking_history == history


def _reply_ids(tok: KimiTokenizer, reasoning: str, answer: str) -> list[int]:
    """The tokens a thinking model generates for one turn, up to its end-of-turn token."""
    if tok.chat_format == "k3":
        return (tok.encode(reasoning) + tok.encode("<|close|>") + tok.encode("think") + tok.encode("<|sep|>")
                + tok.encode("<|open|>") + tok.encode("response") + tok.encode("<|sep|>") + tok.encode(answer)
                + tok.encode("<|close|>") + tok.encode("response") + tok.encode("<|sep|><|close|>") + tok.encode("message")
                + tok.encode("<|sep|><|end_of_msg|>"))
    return tok.encode(f"<think>{reasoning}</think>{answer}<|im_end|>")


def test_each_k3_prompt_extends_the_previous_turn_so_the_prefix_cache_hits(
        k3: KimiTokenizer, k2: KimiTokenizer) -> None:
    # What a prefix cache sees: turn 1's prompt plus the tokens the model generated, then turn 2's prompt.
    turn1 = CONVERSATION[:1]
    turn2 = CONVERSATION[:3]
    for tok, extends in ((k3, True), (k2, False)):
        cached = tok.encode(tok.apply_chat_template(turn1)) + _reply_ids(tok, "17 * 3 = 51.", "51.")
        prompt2 = tok.encode(tok.apply_chat_template(turn2))
        assert (prompt2[:len(cached)] == cached) is extends
    # K2-style: the cached tokens stop matching right after "<think>" of the first reply
    cached = k2.encode(k2.apply_chat_template(turn1))
    think = k2.token_to_id("<think>")
    prompt2 = k2.encode(k2.apply_chat_template(turn2))
    assert prompt2[len(cached)] == think and prompt2[len(cached) + 1] == k2.token_to_id("</think>")


def test_a_request_may_override_the_family_through_chat_template_kwargs(
        k3: KimiTokenizer, k2: KimiTokenizer) -> None:
    # like Kimi's API `thinking.keep: "all"` for K2.6, as a template variable
    model = ServedModel(tokenizer=k2, model_id="k2", context_window=4096, output_format=KIMI_OUTPUT)
    request = ChatCompletionRequest.model_validate({
        "model": "k2", "messages": CONVERSATION, "chat_template_kwargs": {"preserve_thinking": True}})
    text = k2.decode(list(build_prompt(request, model, 16).token_ids), skip_special_tokens=False)
    assert "<think>17 * 3 = 51.</think>" in text and "<think>51 + 9 = 60.</think>" in text
    assert "17 * 3 = 51." in k3.apply_chat_template(CONVERSATION)  # K3's format always keeps it when thinking
    # without the override the gateway renders each family's own way
    plain = ChatCompletionRequest.model_validate({"model": "k2", "messages": CONVERSATION})
    assert "51 + 9" not in k2.decode(list(build_prompt(plain, model, 16).token_ids))


def test_an_unknown_thinking_history_is_refused() -> None:
    with pytest.raises(TokenizerError, match="thinking_history must be"):
        KimiTokenizer.from_dir(SHARED, thinking_history="some")  # type: ignore[arg-type]
