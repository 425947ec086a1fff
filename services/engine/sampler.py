"""Turning logits into tokens: logit rules, then greedy, temperature, top-k, top-p, seeded.

A seeded request draws step ``i`` from a generator seeded by (seed, i), so its tokens do not
depend on which instance runs the step or what else is in the batch.

Before sampling, a row's logits go through its rules, in this order (as vLLM applies them):
repetition penalty (over the prompt and the output), frequency and presence penalties (over
the output), ``logit_bias``, ``min_tokens`` (stop tokens masked until that many were
generated), then the constraint's mask of allowed tokens (structured outputs). Each rule looks
at its own row only, so a request's tokens do not depend on its batch.

``step`` is the number of tokens the request has generated before this one (migrations
included), so the output so far is the last ``step`` ids of the row's history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 means off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 means off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # what min_tokens holds back
    # Report each token's raw log-probability with this many alternatives (logprobs.py); None: off.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_rules(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


def apply_rules(logits: torch.Tensor, cfg: SamplingConfig, history: Sequence[int], step: int,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """A new 1-D float32 row with ``cfg``'s rules and the ``allowed`` mask (bool, vocab) applied."""
    out = logits.float().clone()
    if cfg.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / cfg.repetition_penalty, values * cfg.repetition_penalty)
    if (cfg.presence_penalty or cfg.frequency_penalty) and step > 0:
        generated = torch.tensor(list(history[len(history) - step:]), dtype=torch.long)
        counts = torch.bincount(generated, minlength=out.shape[-1])[: out.shape[-1]].float()
        out -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0).float()
    for token_id, bias in cfg.logit_bias:
        if 0 <= token_id < out.shape[-1]:
            out[token_id] += bias
    if allowed is not None:
        out = out.masked_fill(~allowed, float("-inf"))
    if step < cfg.min_tokens and cfg.stop_token_ids:
        held = out.clone()
        held[[t for t in cfg.stop_token_ids if 0 <= t < out.shape[-1]]] = float("-inf")
        if bool(torch.isfinite(held).any()):  # when only a stop token is allowed (a finished constraint), it wins
            out = held
    return out


def _filtered_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        drop = cumulative - sorted_probs >= cfg.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, step: int) -> int:
    """One token from 1-D ``logits`` (rules already applied) for generation step ``step``."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = _filtered_probs(logits.float(), cfg)
    generator = None
    if cfg.seed is not None:
        generator = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index with probability ``probs[i] / probs.sum()``: inverse CDF with one uniform number.
    ``torch.multinomial`` draws one exponential per vocabulary entry (49,152 for the default
    model: 2 ms a row, 7% of a decode step at batch 8); this draws one number. The CDF is summed
    in float64, so a token's share of [0, 1) is its probability to ~1e-16."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    # The first entry whose CDF exceeds u: never a zero-probability one (its CDF equals the previous).
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), probs.numel() - 1)


def sample_batch(logits: torch.Tensor, cfgs: list[SamplingConfig], steps: list[int],
                 histories: Sequence[Sequence[int]] | None = None,
                 allowed: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """Tokens for a batch: ``logits`` (batch, vocab). ``histories`` (prompt + output so far per row)
    is needed by rows with rules; ``allowed`` holds each row's constraint mask (None: free).
    Rows with neither rules nor a mask and greedy sampling share one argmax."""
    argmax = torch.argmax(logits, dim=-1).tolist()
    out = []
    for i, cfg in enumerate(cfgs):
        mask = allowed[i] if allowed is not None else None
        row = logits[i]
        if cfg.has_rules or mask is not None:
            row = apply_rules(row, cfg, histories[i] if histories is not None else (), steps[i], mask)
        elif cfg.greedy:
            out.append(argmax[i])
            continue
        if not bool(torch.isfinite(row).any()):
            raise ValueError("no token is allowed: the constraint and the sampling rules exclude every token")
        out.append(sample_token(row, cfg, steps[i]))
    return out
