"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded.

A seeded request draws step ``i`` from a generator seeded by (seed, i), so its tokens do not
depend on which instance runs the step or what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 means off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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
    """One token from 1-D ``logits`` for generation step ``step`` (0 for the first token)."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = _filtered_probs(logits.float(), cfg)
    generator = None
    if cfg.seed is not None:
        generator = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, cfgs: list[SamplingConfig], steps: list[int]) -> list[int]:
    """Tokens for a batch: ``logits`` (batch, vocab); greedy rows share one argmax."""
    argmax = torch.argmax(logits, dim=-1).tolist()
    return [argmax[i] if cfg.greedy else sample_token(logits[i], cfg, steps[i]) for i, cfg in enumerate(cfgs)]
