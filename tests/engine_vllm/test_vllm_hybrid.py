"""A hybrid model through CrescentConnector on real vLLM processes (vLLM's hybrid memory
allocator, ``SupportsHMA``): a prompt prefix computed by one vLLM engine reaches the kvstore as
attention blocks plus the recurrent-state snapshot vLLM kept at a block boundary, and a fresh
engine resumes from them (vLLM counts the loaded tokens as cached) with the same greedy output;
another tenant's request finds nothing.

The checkpoint is a tiny Qwen3-Next (Gated DeltaNet recurrent layers beside full attention),
written by transformers' own ``save_pretrained``: vLLM 0.32's CPU build cannot run Kimi-Linear
(its MLA needs ``kv_b_proj.weight`` after the CPU linear layers dropped it, and MLA turns
prefix caching off on CPU: docs/engine-backends.md), while its CPU GDN kernels run Qwen3-Next in
bf16. Both are the same to the connector: ``MambaSpec`` state groups in ``align`` mode beside
full-attention groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.engine_vllm.vllm_stack import (
    CONTROL_PLANE_START_S, Service, listen, start_service, vllm_interpreter, wait_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

BLOCK = 256  # vLLM sets this model's block size (attention pages as large as a state page)
DRIVER = Path(__file__).with_name("hybrid_driver.py")
PROMPT = [3 + (i * 7) % 500 for i in range(697)]  # two full blocks and a partial one

WRITE_CHECKPOINT = textwrap.dedent("""
    import sys, torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():  # weights large enough that the greedy output depends on every layer
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(sys.argv[1])
""")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def checkpoint(run_dir: Path) -> Path:
    path = run_dir / "tiny-qwen3-next"
    subprocess.run([vllm_interpreter(), "-c", WRITE_CHECKPOINT, str(path)], check=True, timeout=300)
    return path


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
    """One fresh vLLM engine (its own processes) running ``jobs`` in order; their results."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache")}
    with open(log, "wb") as out:
        done = subprocess.run([vllm_interpreter(), str(DRIVER), str(checkpoint), store.grpc, str(BLOCK), json.dumps(jobs)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, text[-6000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_a_hybrid_prefix_is_served_from_the_kvstore_to_a_fresh_vllm(checkpoint: Path, kvstore: Service,
                                                                      run_dir: Path) -> None:
    # vLLM keeps a recurrent state at a block boundary only where it has seen the prefix reused:
    # the first run computes the prompt in one chunk, the second one stops at 512 and keeps it.
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
