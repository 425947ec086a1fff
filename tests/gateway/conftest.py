"""Fixtures: one fake backend and one gateway process for the whole gateway test session."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .fake_tokenizer import MODEL_ID
from .support import FakeBackend, Gateway


@pytest.fixture(scope="session")
def backend() -> Iterator[FakeBackend]:
    fake = FakeBackend()
    fake.start_backend()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("gateway"), backend.address)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0, "the gateway did not stop cleanly on SIGTERM"


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
def model() -> str:
    return MODEL_ID
