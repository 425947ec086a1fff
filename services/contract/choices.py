"""What the gateway, the scheduler and the engines agree on about ``n`` choices of one prompt.

A request with ``n > 1`` is prefilled once; prefill samples each choice's first token from the
same logits, and decode runs the n sequences on the prompt's shared KV (full blocks shared,
the last partial block copied per choice). If the group's placement fails, each unfinished
choice continues as a request of its own, so both sides must derive a choice's seed the same way.
The KV the choices need is counted here once: in tokens by the scheduler, in cache pages by decode.
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


def reserve_tokens(prompt_tokens: int, max_tokens: int, context_window: int) -> int:
    """KV tokens one sequence may ever hold: prompt + max_tokens, within the context window."""
    return min(prompt_tokens + max_tokens, context_window)


def shared_prompt_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt's tokens the choices share: its full blocks (each choice copies the partial last one)."""
    return prompt_tokens // block_size * block_size


def choices_kv_tokens(prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Decode KV tokens ``n`` choices of one prompt may hold (the scheduler's count): the shared
    full blocks once, plus each choice's own copy of the last partial block and its own output."""
    shared = shared_prompt_tokens(prompt_tokens, block_size)
    return shared + max(n, 1) * (prompt_tokens + max_tokens - shared)


def choice_own_pages(prompt_tokens: int, reserve_tokens: int, block_size: int) -> int:
    """Cache pages one of several choices holds alone: its ``reserve_tokens`` but the shared blocks."""
    return -(-(reserve_tokens - shared_prompt_tokens(prompt_tokens, block_size)) // block_size)


def choices_kv_pages(prompt_tokens: int, reserve_tokens: int, n: int, block_size: int) -> int:
    """Cache pages ``n`` choices may hold (decode's count, the same split as ``choices_kv_tokens``
    in whole pages): the shared blocks once, plus each choice's own pages."""
    shared_pages = prompt_tokens // block_size
    return shared_pages + max(n, 1) * choice_own_pages(prompt_tokens, reserve_tokens, block_size)
