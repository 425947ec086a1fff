"""Fixtures: one fake backend and one gateway for the whole gateway test session, served in-process
(``in_process.py``: no process to start, so the tests using only these run in ``make test-fast``)."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import openai
import pytest

from .fake_tokenizer import MODEL_ID
from .in_process import InProcessBackend, InProcessGateway

# The openai client's request headers name the processor, which Python learns from `uname -p` (a
# process) and caches: learn it at collection, so no not-slow test starts it (tests/process_guard.py).
platform.processor()


@pytest.fixture(scope="session")
def backend() -> Iterator[InProcessBackend]:
    fake = InProcessBackend()
    fake.start_backend()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def gateway(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessGateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("gateway"), backend.address)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0, "the gateway did not stop cleanly"


@pytest.fixture
def client(gateway: InProcessGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
def model() -> str:
    return MODEL_ID
