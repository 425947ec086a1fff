"""One source of truth for the block size: the gateway uses what the model's instances report to
the scheduler, not its own setting, and follows a change (Place refuses a stale one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from crescent.services.contract.block_keys import prefix_block_keys

from .fake_tokenizer import MODEL_ID
from .in_process import InProcessBackend, InProcessGateway
from .support import BLOCK_SIZE, FakeBackend, Gateway, served_salt


@pytest.fixture
def own_backend() -> Iterator[FakeBackend]:
    fake = InProcessBackend()
    fake.start_backend()
    yield fake
    fake.stop()


def ask(gw: Gateway, content: str) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)


def test_a_wrong_block_size_setting_is_overridden(own_backend: FakeBackend, tmp_path: Path) -> None:
    gw = InProcessGateway(tmp_path, own_backend.address, block_size=BLOCK_SIZE * 4)  # disagrees with the engines
    gw.start_gateway()
    try:
        assert ask(gw, "a prompt of several blocks").status_code == 200
    finally:
        assert gw.stop() == 0
    place = own_backend.get("/places")[-1]
    assert place["block_size"] == BLOCK_SIZE


def test_the_gateway_follows_a_new_block_size(own_backend: FakeBackend, tmp_path: Path) -> None:
    gw = InProcessGateway(tmp_path, own_backend.address)
    gw.start_gateway()
    try:
        assert ask(gw, "before the redeploy").status_code == 200
        own_backend.put("/block-size", {"block_size": 8})
        reply = ask(gw, "after the redeploy")
        assert reply.status_code == 200
    finally:
        assert gw.stop() == 0
    refused, accepted = own_backend.get("/places")[-2:]
    assert refused["request_id"] == accepted["request_id"] == reply.json()["id"]
    assert (refused["block_size"], accepted["block_size"]) == (BLOCK_SIZE, 8)
    prompt = own_backend.get("/prefills")[-1]["token_ids"]
    assert accepted["block_keys"] == [k.hex() for k in prefix_block_keys(prompt, 8, MODEL_ID, served_salt())]
