"""Processes the vLLM tests share. vLLM's CPU start takes 50-300 s on this machine, so what can be
shared is started once per session:

- ``vllm_peer``: the standalone vLLM server on the same weights, the reference every module
  compares Crescent-over-vLLM with. Started on first use and not waited for, so its start overlaps
  the first stack's engines; ``VllmStack.start`` waits for it.
- ``vllm_stack``: a factory for a module's own stack (scheduler, kvstore, gateway, engines)
  around that peer, stopped at the module's end. Modules keep their own engines because their
  last tests kill or drain them.

- ``tiny_hybrid_checkpoint``: the tiny Qwen3-Next (recurrent + attention layers, with a
  tokenizer) the hybrid modules serve, written once (tests/engine_vllm/tiny_hybrid.py).

A new module (say one testing another vLLM feature) takes ``vllm_peer`` directly, or
``vllm_stack({"aggregated-0": "aggregated"})`` inside a module-scoped fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crescent.services.engine_vllm.model_dir import vllm_model
from tests.engine_vllm.tiny_hybrid import write_tiny_hybrid
from tests.engine_vllm.vllm_stack import BLOCK, MODEL, PeerVllm, VllmStack, vllm_interpreter


@pytest.fixture(scope="session")
def vllm_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerVllm]:
    python = vllm_interpreter()
    if python is None:
        pytest.skip("make install-vllm first")
    model = vllm_model(MODEL)  # the HF directory every vLLM loads (exported once from the GGUF)
    peer = PeerVllm(tmp_path_factory.mktemp("vllm-peer"), python, model.directory, MODEL, BLOCK)
    try:
        yield peer
    finally:
        peer.stop()


@pytest.fixture(scope="module")
def vllm_stack(vllm_peer: PeerVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[dict[str, str]], VllmStack]]:
    """``vllm_stack(engines)`` (instance id -> role) starts this module's stack; stopped after the module."""
    stacks: list[VllmStack] = []

    def start(engines: dict[str, str]) -> VllmStack:
        stack = VllmStack(tmp_path_factory.mktemp("vllm"), vllm_peer)
        stacks.append(stack)
        stack.start(engines)
        return stack

    try:
        yield start
    finally:
        for stack in stacks:
            stack.stop()


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = vllm_interpreter()
    if python is None:
        pytest.skip("make install-vllm first")
    return write_tiny_hybrid(python, tmp_path_factory.mktemp("hybrid-checkpoint") / "tiny-qwen3-next")
