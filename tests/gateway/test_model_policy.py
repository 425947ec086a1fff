"""Model cards: reasoning controls, sampling defaults, locked parameters, and chat_template_kwargs.

Checked on real gateway processes: one serving kimi-k3-nano (Kimi's tokenizer, K3's chat format and
card), one with the fake tokenizer and a card from its settings file. The fake backend
records what prefill received (the prompt's token ids and the sampling parameters).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.errors import InvalidRequestError
from crescent.services.gateway.model_policy import K3_POLICY, NO_POLICY, ModelPolicy, SamplingPolicy, policy_for

from .fake_tokenizer import MODEL_ID
from .in_process import InProcessGateway
from .support import PRODUCTION_ENTRY, FakeBackend, Gateway

KIMI_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"
USER = [{"role": "user", "content": "hi"}]
CARD = {"reasoning_efforts": ["medium", "high"], "sampling": {"defaults": {"max_tokens": 7},
                                                               "locked": {"temperature": 0.3}}}


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def test_k3_card_fills_defaults_per_thinking_mode() -> None:
    thinking = K3_POLICY.apply(request())
    assert (thinking.thinking.type, thinking.temperature, thinking.top_p, thinking.reasoning_effort) == \
        ("enabled", 1.0, 0.95, "max")
    instant = K3_POLICY.apply(request(thinking={"type": "disabled"}))
    assert (instant.temperature, instant.top_p, instant.reasoning_effort) == (0.6, 0.95, None)


def test_k3_locks_sampling_per_thinking_mode_and_names_what_it_refuses() -> None:
    assert K3_POLICY.apply(request(top_p=0.95, temperature=1.0)).top_p == 0.95
    for fields, param in (({"top_p": 0.5}, "top_p"), ({"temperature": 0.6}, "temperature"),
                          ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1.0},
                                                                             "frequency_penalty"),
                          ({"n": 2}, "n"), ({"temperature": 1.0, "thinking": {"type": "disabled"}}, "temperature")):
        with pytest.raises(InvalidRequestError) as caught:
            K3_POLICY.apply(request(**fields))
        assert (caught.value.param, caught.value.code) == (param, "locked_parameter")
    with pytest.raises(InvalidRequestError, match="thinking enabled"):
        K3_POLICY.apply(request(top_p=0.5))


def test_thinking_effort_wins_and_both_efforts_are_ignored_when_thinking_is_off() -> None:
    both = K3_POLICY.apply(request(reasoning_effort="low", thinking={"type": "enabled", "effort": "high"}))
    assert (both.reasoning_effort, both.thinking.effort) == ("high", "high")
    assert K3_POLICY.apply(request(reasoning_effort="low")).thinking.effort == "low"
    off = K3_POLICY.apply(request(reasoning_effort="bogus", thinking={"type": "disabled", "effort": "bogus"}))
    assert (off.reasoning_effort, off.thinking.effort) == (None, None)
    with pytest.raises(InvalidRequestError) as caught:
        K3_POLICY.apply(request(thinking={"type": "enabled", "effort": "medium"}))
    assert caught.value.param == "thinking.effort" and "max, low, high" in caught.value.message
    with pytest.raises(InvalidRequestError, match="reasoning_effort 'medium'"):
        K3_POLICY.apply(request(reasoning_effort="medium"))


def test_thinking_keep_all_is_accepted_where_the_model_takes_it() -> None:
    assert K3_POLICY.apply(request(thinking={"type": "enabled", "keep": "all"})).thinking.keep == "all"
    with pytest.raises(InvalidRequestError) as caught:
        K3_POLICY.apply(request(thinking={"type": "enabled", "keep": "last"}))
    assert caught.value.param == "thinking.keep"


def test_cards_follow_the_model_family_not_the_tokenizer() -> None:
    assert policy_for("kimi_k3") is K3_POLICY
    assert policy_for("kimi_linear") is NO_POLICY  # Kimi's tokenizer, but no thinking model
    with pytest.raises(InvalidRequestError, match="no thinking control"):
        policy_for("kimi_linear").apply(request(thinking={"type": "enabled"}))


def test_a_max_tokens_default_never_overrides_max_completion_tokens() -> None:
    card = ModelPolicy(sampling=SamplingPolicy(defaults={"max_tokens": 9}))
    assert card.apply(request()).max_tokens == 9
    assert card.apply(request(max_completion_tokens=30)).requested_max_tokens() == 30


def test_a_card_whose_lock_contradicts_its_default_does_not_load() -> None:
    with pytest.raises(ValueError, match="locked to one value"):
        ModelPolicy(sampling=SamplingPolicy(defaults={"temperature": 1.0}, locked={"temperature": 0.5}))


@pytest.fixture(scope="module")
def kimi(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if not (KIMI_DIR / "tiktoken.model").is_file():
        pytest.skip(f"no Kimi vocabulary at {KIMI_DIR}")
    gw = InProcessGateway(tmp_path_factory.mktemp("kimi-card"), backend.address, entry=PRODUCTION_ENTRY,
                          model="kimi-k3-nano")
    gw.start_gateway(timeout_s=60)
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="module")
def carded(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("carded"), backend.address, model_policy=CARD)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def post(gw: Gateway, model: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", json={"model": model, "messages": USER, **fields}, timeout=20)


def test_kimi_thinking_switch_and_effort_reach_the_prompt_and_the_sampling(kimi: Gateway,
                                                                          backend: FakeBackend) -> None:
    from crescent.services.model.kimi_tokenizer import tokenizer_for
    from crescent.services.model.model_source import resolve_model

    tokenizer = tokenizer_for(resolve_model("kimi-k3-nano"))
    assert post(kimi, "kimi-k3-nano", thinking={"type": "disabled"}).status_code == 200
    sent = backend.get("/prefills")[-1]
    prompt = tokenizer.decode(sent["token_ids"], skip_special_tokens=False)
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert "thinking_effort" not in prompt
    assert sent["temperature"] == pytest.approx(0.6)
    assert post(kimi, "kimi-k3-nano", reasoning_effort="low").status_code == 200
    sent = backend.get("/prefills")[-1]
    prompt = tokenizer.decode(sent["token_ids"], skip_special_tokens=False)
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert "Now the system is invoked with `thinking_effort=low`." in prompt
    assert (sent["temperature"], sent["top_p"]) == (pytest.approx(1.0), pytest.approx(0.95))
    refused = post(kimi, "kimi-k3-nano", top_p=0.5).json()["error"]
    assert (refused["param"], refused["code"]) == ("top_p", "locked_parameter")


def test_the_card_is_on_the_model_endpoint(kimi: Gateway, carded: Gateway) -> None:
    card = httpx.get(f"{kimi.url}/v1/models/kimi-k3-nano", timeout=5).json()["policy"]
    assert card["reasoning_efforts"] == ["max", "low", "high"] and card["thinking"] == ["enabled", "disabled"]
    assert card["when_thinking"]["locked"] == {"temperature": 1.0}
    assert card["sampling"]["locked"]["top_p"] == 0.95 and card["thinking_keep"] == ["all"]
    listed = httpx.get(f"{carded.url}/v1/models", timeout=5).json()["data"][0]["policy"]
    assert listed["sampling"] == {"defaults": {"max_tokens": 7.0}, "locked": {"temperature": 0.3}}


def test_a_card_from_the_settings_file_applies(carded: Gateway, backend: FakeBackend) -> None:
    assert post(carded, MODEL_ID, reasoning_effort="high").status_code == 200
    sent = backend.get("/prefills")[-1]
    assert sent["max_tokens"] == 7 and sent["temperature"] == pytest.approx(0.3)
    error = post(carded, MODEL_ID, temperature=1.0).json()["error"]
    assert (error["param"], error["code"]) == ("temperature", "locked_parameter")
    error = post(carded, MODEL_ID, reasoning_effort="max").json()["error"]
    assert error["param"] == "reasoning_effort" and "medium, high" in error["message"]


def test_a_model_without_reasoning_controls_refuses_them_by_name(gateway: Gateway) -> None:
    error = post(gateway, MODEL_ID, reasoning_effort="high").json()["error"]
    assert error["param"] == "reasoning_effort" and "no reasoning effort control" in error["message"]
    error = post(gateway, MODEL_ID, thinking={"type": "enabled"}).json()["error"]
    assert error["param"] == "thinking.type"


def test_chat_template_kwargs_reach_the_template_but_not_the_gateways_names(gateway: Gateway) -> None:
    assert post(gateway, MODEL_ID, chat_template_kwargs={"custom_flag": True}).status_code == 200
    for name in ("messages", "add_generation_prompt", "thinking"):
        error = post(gateway, MODEL_ID, chat_template_kwargs={name: 1}).json()["error"]
        assert error["param"] == f"chat_template_kwargs.{name}", error
