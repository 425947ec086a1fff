"""What the gateway and the engines agree on about ``n`` choices of one prompt.

A request with ``n > 1`` is prefilled once; prefill samples each choice's first token from the
same logits, and decode runs the n sequences on the prompt's shared KV (full blocks shared,
the last partial block copied per choice). If the group's placement fails, each unfinished
choice continues as a request of its own, so both sides must derive a choice's seed the same way.
"""

from __future__ import annotations

import hashlib

MAX_CHOICES = 16  # n per prompt


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` samples with: ``seed`` for choice 0, else a signed 64-bit value
    derived from (seed, index) by BLAKE2b, the same on every gateway, engine and run."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"crescent-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def choices_kv_tokens(prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Decode KV tokens ``n`` choices of one prompt may hold: the prompt once, plus each further
    choice's own copy of the prompt's last partial block and its own output."""
    n = max(n, 1)
    return prompt_tokens + max_tokens + (n - 1) * (prompt_tokens % block_size + max_tokens)
