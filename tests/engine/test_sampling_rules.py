"""Logit rules (penalties, logit_bias, min_tokens, constraint masks) against a plain reference.

The reference applies each rule token by token in Python, the way the OpenAI and vLLM docs
define them; the sampler's tensor version must agree, and a row's token must not depend on the
other rows of its batch.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from crescent.services.engine.sampler import SamplingConfig, apply_rules, sample_batch

VOCAB = 64


def reference_rules(logits: list[float], cfg: SamplingConfig, history: list[int], step: int) -> list[float]:
    out = list(logits)
    if cfg.repetition_penalty != 1.0:
        for t in set(history):
            out[t] = out[t] / cfg.repetition_penalty if out[t] > 0 else out[t] * cfg.repetition_penalty
    generated = history[len(history) - step:] if step else []
    for t in set(generated):
        out[t] -= cfg.frequency_penalty * generated.count(t) + cfg.presence_penalty
    for t, bias in cfg.logit_bias:
        out[t] += bias
    if step < cfg.min_tokens:
        for t in cfg.stop_token_ids:
            out[t] = -math.inf
    return out


@pytest.mark.parametrize("seed", range(6))
def test_rules_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    cfg = SamplingConfig(
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([1.0, 0.7, 1.3]), logit_bias=((3, 5.0), (9, -100.0)),
        min_tokens=rng.choice([0, 5]), stop_token_ids=(0, 1),
    )
    logits = [rng.gauss(0, 3) for _ in range(VOCAB)]
    history = [rng.randrange(VOCAB) for _ in range(20)]
    step = rng.randrange(0, 12)
    got = apply_rules(torch.tensor(logits), cfg, history, step).tolist()
    want = reference_rules(logits, cfg, history, step)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_logit_bias_decides_a_greedy_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 3.0
    assert sample_batch(logits, [SamplingConfig()], [0]) == [7]
    assert sample_batch(logits, [SamplingConfig(logit_bias=((42, 10.0),))], [0], [[]]) == [42]
    assert sample_batch(logits, [SamplingConfig(logit_bias=((7, -100.0),))], [0], [[]]) != [7]


def test_min_tokens_holds_back_stop_tokens_until_then() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # the stop token is by far the likeliest
    cfg = SamplingConfig(min_tokens=3, stop_token_ids=(2,))
    assert [sample_batch(logits, [cfg], [step], [[5] * step])[0] == 2 for step in range(5)] == \
        [False, False, False, True, True]


def test_a_constraint_mask_wins_over_min_tokens_when_only_a_stop_token_is_left() -> None:
    logits = torch.randn(1, VOCAB)
    only_stop = torch.zeros(VOCAB, dtype=torch.bool)
    only_stop[2] = True
    cfg = SamplingConfig(min_tokens=10, stop_token_ids=(2,))
    assert sample_batch(logits, [cfg], [0], [[]], [only_stop]) == [2]


def test_masked_sampling_only_takes_allowed_tokens() -> None:
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[4, 8, 15]] = True
    hot = SamplingConfig(temperature=1.5, seed=3)
    tokens = {sample_batch(torch.randn(1, VOCAB), [hot], [step], [[]], [allowed])[0] for step in range(60)}
    assert tokens <= {4, 8, 15} and len(tokens) > 1
    with pytest.raises(ValueError, match="no token is allowed"):
        sample_batch(torch.randn(1, VOCAB), [hot], [0], [[]], [torch.zeros(VOCAB, dtype=torch.bool)])


def test_a_row_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    cfgs = [SamplingConfig(), SamplingConfig(temperature=0.9, seed=5, presence_penalty=1.0),
            SamplingConfig(repetition_penalty=1.5), SamplingConfig(temperature=1.2, seed=9, logit_bias=((1, 3.0),))]
    histories = [[1, 2, 3], [4, 4, 5], [6, 7], [8]]
    steps = [1, 2, 0, 1]
    together = sample_batch(logits, cfgs, steps, histories)
    alone = [sample_batch(logits[i:i + 1], cfgs[i:i + 1], steps[i:i + 1], histories[i:i + 1])[0] for i in range(4)]
    assert together == alone


def test_draws_follow_the_probabilities_and_never_pick_an_excluded_token() -> None:
    """The sampler's one-uniform inverse-CDF draw against the distribution it samples (chi-square
    over 20,000 seeded draws) and against zero-probability tokens at either end and between."""
    from crescent.services.engine.sampler import draw

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    generator = torch.Generator().manual_seed(1234)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(20_000)]), minlength=7).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * 20_000
    kept = probs > 0
    chi2 = float((((counts - expected) ** 2)[kept] / expected[kept]).sum())
    assert chi2 < 16.3, f"chi-square {chi2:.1f} with 3 degrees of freedom (p < 0.001 above 16.3)"
    unnormalised = torch.tensor([3.0, 0.0, 1.0])
    picks = {draw(unnormalised, torch.Generator().manual_seed(s)) for s in range(200)}
    assert picks == {0, 2}, "weights need not sum to one; a zero weight is never drawn"
    again = [draw(probs, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert len(set(again)) == 1, "the same seed draws the same token"
