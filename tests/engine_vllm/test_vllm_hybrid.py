"""A hybrid model through CrescentConnector on real vLLM processes (vLLM's hybrid memory
allocator, ``SupportsHMA``): a prompt prefix computed by one vLLM engine reaches the kvstore as
attention blocks plus the recurrent-state snapshot vLLM kept at a block boundary, and a fresh
engine resumes from them (vLLM counts the loaded tokens as cached) with the same greedy output;
another tenant's request finds nothing.

The checkpoint is a tiny Qwen3-Next (Gated DeltaNet recurrent layers beside full attention,
tests/engine_vllm/tiny_hybrid.py). The same model through prefill and decode pools:
test_vllm_hybrid_pools.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_vllm.tiny_hybrid import BLOCK, run_driver
from tests.engine_vllm.vllm_stack import (
    CONTROL_PLANE_START_S, Service, listen, start_service, vllm_interpreter, wait_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

# Two full blocks and one token: the fresh engine computes that token straight from the loaded
# snapshot (the tiny model's gated recurrence forgets a wrong state within a few dozen tokens).
PROMPT = [3 + (i * 7) % 500 for i in range(513)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def kvstore(run_dir: Path):  # noqa: ANN201
    scheduler = start_service(run_dir, "scheduler", "scheduler", {"listen": listen()})
    store = start_service(run_dir, "kvstore", "kvstore", {
        "listen": listen(), "node_id": "kvstore-0", "scheduler_address": scheduler.grpc,
        "tiers": {"host": {"capacity_bytes": 500_000_000}}})
    try:
        wait_healthy([scheduler, store], CONTROL_PLANE_START_S)
        yield store
    finally:
        for service in (store, scheduler):
            service.stop(timeout_s=30)


def fresh_vllm(checkpoint: Path, store: Service, jobs: list[dict], log: Path) -> list[dict]:
    """One fresh vLLM engine (its own processes), the connector on ``store``, running ``jobs``."""
    return run_driver(checkpoint, store.grpc, jobs, log)


def test_a_hybrid_prefix_is_served_from_the_kvstore_to_a_fresh_vllm(tiny_hybrid_checkpoint: Path, kvstore: Service,
                                                                      run_dir: Path) -> None:
    checkpoint = tiny_hybrid_checkpoint
    # vLLM keeps the recurrent state at the prompt's replay boundary (its length minus one,
    # floored to a block: 512): the first run ends a chunk there, the second hits vLLM's own cache.
    first, second = fresh_vllm(checkpoint, kvstore, [{"prompt": PROMPT, "tenant": "acme"}] * 2,
                               run_dir / "vllm-a.log")
    assert first["cached"] == 0
    assert second["tokens"] == first["tokens"]

    mine, theirs = fresh_vllm(checkpoint, kvstore, [{"prompt": PROMPT, "tenant": "acme"},
                                                     {"prompt": PROMPT, "tenant": "globex"}], run_dir / "vllm-b.log")
    assert mine["cached"] >= BLOCK, "the fresh engine resumed from the kvstore's blocks and snapshot"
    assert mine["cached"] % BLOCK == 0 and mine["cached"] <= (len(PROMPT) - 1) // BLOCK * BLOCK
    assert mine["tokens"] == first["tokens"], "the same greedy output as computing the whole prompt"
    assert theirs["cached"] == 0, "another tenant never loads acme's blocks"
    assert theirs["tokens"] == first["tokens"]
