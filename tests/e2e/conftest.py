"""The default-shape stack the request-path modules share (``stack``: one ``crescent up`` for all
of them) and the in-process reference model.

Both live as long as this folder's tests, not the session's (a full run goes on for half an
hour after tests/e2e: an idle stack holds its engines' memory and heartbeats meanwhile). The
modules that use ``stack`` run last here, so that the other modules' stacks (each its own
shape: aggregated, two prefills, tiers, auth, K3, or stopped by the test) never run beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from tests.e2e.stack import Stack, start_stack, stop_stack

KV_TOKENS = 2048  # small on purpose: long prompts push earlier blocks out to the kvstore
E2E = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's modules that use ``stack`` after the others (stable otherwise), in the
    places this folder's tests had among the session's items."""
    slots = [i for i, item in enumerate(items) if E2E in Path(str(item.path)).resolve().parents]
    ordered = sorted((items[i] for i in slots), key=lambda item: "stack" in getattr(item, "fixturenames", ()))
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    running = start_stack(tmp_path_factory.mktemp("stack"), "--kv-capacity-tokens", str(KV_TOKENS))
    yield running
    stop_stack(running)


@pytest.fixture(scope="package")
def reference():
    """The same model in this process: what the platform's output must equal."""
    torch.set_num_threads(2)
    loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=16384, block_size=64)
    return engine, loaded.tokenizer
