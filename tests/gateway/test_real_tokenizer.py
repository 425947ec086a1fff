"""The production entry (``server.main`` with the default model loader) and the real tokenizer.

The gateway loads only the default model's tokenizer and chat template (no weights); the fake
backend stands in for the rest, so this checks what the gateway sends, not what a model says.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from crescent.services.contract.block_keys import prefix_block_keys
from crescent.services.model.model_source import DEFAULT_MODEL, ModelSpecError, resolve_model
from crescent.services.model.tokenizer import Tokenizer

from .in_process import InProcessGateway
from .support import BLOCK_SIZE, PRODUCTION_ENTRY, FakeBackend, Gateway, served_salt


# In-process (no process to start), but loading SmolLM2's tokenizer here and in the gateway took
# 50 s of the inner loop on the shared 2-core machine: `slow` is for tests over a few seconds.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Tokenizer]]:
    """The gateway as production starts it, and the same tokenizer here (loaded while it starts)."""
    try:
        source = resolve_model(DEFAULT_MODEL)
    except ModelSpecError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    gw = InProcessGateway(tmp_path_factory.mktemp("real"), backend.address, entry=PRODUCTION_ENTRY)
    gw.spawn()
    try:
        tokenizer = Tokenizer.for_model(source)
        gw.wait_gateway(timeout_s=60)
        yield gw, tokenizer
    finally:
        assert gw.stop() == 0


@pytest.fixture
def real_gateway(real: tuple[Gateway, Tokenizer]) -> Gateway:
    return real[0]


@pytest.fixture
def real_tokenizer(real: tuple[Gateway, Tokenizer]) -> Tokenizer:
    return real[1]


def test_lists_the_default_model(real_gateway: Gateway) -> None:
    models = httpx.get(f"{real_gateway.url}/v1/models", timeout=5).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(DEFAULT_MODEL, 8192)]


def test_sends_the_templated_prompt_and_its_block_keys(real_gateway: Gateway, backend: FakeBackend,
                                                       real_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
    # A scripted rejection stops the request right after placement, which is what we inspect.
    backend.post("/reject", {"reason": "ttft_slo", "message": "busy", "retry_after_s": 1})
    reply = httpx.post(f"{real_gateway.url}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": messages},
                       timeout=10)
    assert reply.status_code == 429
    place = backend.get("/places")[-1]
    ids = real_tokenizer.encode(real_tokenizer.apply_chat_template(messages))
    assert ids[0] == real_tokenizer.encode("<|im_start|>")[0]  # ChatML, no extra BOS
    assert place["prompt_tokens"] == len(ids)
    assert place["block_keys"] == [k.hex() for k in prefix_block_keys(ids, BLOCK_SIZE, DEFAULT_MODEL, served_salt())]
    assert place["model_id"] == DEFAULT_MODEL


def test_rejects_a_prompt_beyond_the_models_context(real_gateway: Gateway) -> None:
    too_long = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}
    reply = httpx.post(f"{real_gateway.url}/v1/chat/completions", json=too_long, timeout=10)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
