"""A tiny hybrid checkpoint for the vLLM tests: a Qwen3-Next (Gated DeltaNet recurrent layers
beside full attention) written by transformers' own ``save_pretrained``, with a small byte-level
BPE tokenizer trained by ``tokenizers`` and saved by transformers beside it, so that both the
engines and the gateway (which reads ``tokenizer.json``) load it as any Hugging Face directory.

vLLM 0.32's CPU build cannot run Kimi-Linear (docs/engine-backends.md), while its CPU GDN kernels
run Qwen3-Next in bf16 (head dims of 64/128). To the connector both are the same: ``MambaSpec``
state groups in ``align`` mode beside full-attention groups. vLLM gives this model 256-token
blocks (attention pages as large as a state page).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

from tests.engine_vllm.vllm_stack import vllm_interpreter

BLOCK = 256
VOCAB = 512
DRIVER = Path(__file__).with_name("hybrid_driver.py")

# Run with the vLLM venv's interpreter (transformers and tokenizers are installed there).
_WRITE = textwrap.dedent("""
    import random, sys, torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3NextConfig, Qwen3NextForCausalLM
    out, vocab = sys.argv[1], int(sys.argv[2])
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
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
    model.save_pretrained(out)

    # Byte-level BPE over an ASCII corpus: every token decodes to whole characters, so streamed
    # and whole-sequence detokenization agree whatever ids the random model picks.
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                                        show_progress=False))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            clean_up_tokenization_spaces=False).save_pretrained(out)
""")


def write_tiny_hybrid(python: str, path: Path) -> Path:
    """Write the checkpoint (weights, config, tokenizer) into ``path`` with ``python`` (vLLM's venv)."""
    subprocess.run([python, "-c", _WRITE, str(path), str(VOCAB)], check=True, timeout=600)
    return path


def run_driver(checkpoint: Path, kvstore: str, jobs: list[dict], log: Path) -> list[dict]:
    """One fresh vLLM engine (its own processes) on ``checkpoint`` running ``jobs`` in order
    (hybrid_driver.py), with Crescent's connector on ``kvstore`` ("" : plain vLLM); their results."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CACHE_ROOT": str(log.parent / "vllm-cache")}
    with open(log, "wb") as out:
        done = subprocess.run([vllm_interpreter(), str(DRIVER), str(checkpoint), kvstore, str(BLOCK), json.dumps(jobs)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, text[-6000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def prompt_ids(length: int, seed: int) -> list[int]:
    """A token-id prompt of ``length`` ordinary tokens (no special ids), one per seed."""
    return [3 + (seed * 7919 + i * (31 + seed)) % (VOCAB - 3) for i in range(length)]
