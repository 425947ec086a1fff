from __future__ import annotations

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from tests.e2e.stack import Stack, start_stack, stop_stack

KV_TOKENS = 2048  # small on purpose: long prompts push earlier blocks out to the kvstore


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    running = start_stack(tmp_path_factory.mktemp("stack"), "--kv-capacity-tokens", str(KV_TOKENS))
    yield running
    stop_stack(running)


@pytest.fixture(scope="session")
def reference():
    """The same model in this process: what the platform's output must equal."""
    torch.set_num_threads(2)
    loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=16384, block_size=64)
    return engine, loaded.tokenizer
