"""Log-probabilities reported with sampled tokens (OpenAI's ``logprobs`` and ``top_logprobs``).

What is reported is the model's own distribution: ``log_softmax`` of the raw logits, before any
logit rule (penalties, ``logit_bias``, ``min_tokens``), temperature, top-k/top-p or constraint
mask (vLLM's default, ``raw_logprobs``). So a token picked under a constraint or a bias may have
a low log-probability, and the alternatives may include tokens the rules excluded: the numbers
say what the model thought, not what the sampler was allowed to pick.

The ``k`` alternatives are the ``k`` largest entries of that same distribution, most likely first;
among equal values the smaller token id comes first (as ``argmax`` picks the first maximum, so a
greedy token with no rules is always ``top[0]``). Each row is computed on its own, so a row's
numbers never depend on the batch it ran in, and only the rows that asked pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit); more would cost a vocabulary sort per token


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def top_tokens(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely (id, log-probability) of a 1-D row; ties go to the smaller id."""
    k = min(k, logprobs.shape[-1])
    if k <= 0:
        return ()
    kth = torch.topk(logprobs, k).values[-1]
    ids = torch.nonzero(logprobs >= kth).flatten()  # ascending ids: every token at or above the k-th value
    values = logprobs[ids]
    order = torch.sort(values, descending=True, stable=True).indices[:k]  # stable: equal values keep id order
    return tuple(zip(ids[order].tolist(), values[order].tolist()))


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """``token_id``'s raw log-probability under 1-D ``logits`` and the ``k`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return TokenLogprob(token_id, float(logprobs[token_id]), top_tokens(logprobs, k))


def batch_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   top: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Per row of ``logits`` (batch, vocab): the sampled token's entry when ``top[i]`` is a count
    of alternatives, None when the row did not ask."""
    return [None if k is None else token_logprob(logits[i], token_ids[i], k) for i, k in enumerate(top)]
