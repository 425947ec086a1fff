"""Reported log-probabilities against a plain reference (math.log of a softmax, token by token).

What a client would notice: the numbers are the model's own distribution whatever rules shaped
the sampling, the alternatives come most likely first (ties in id order), a greedy token is the
first alternative, and a row's numbers do not depend on the other rows of its batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from crescent.services.engine.logprobs import batch_logprobs, token_logprob, top_tokens
from crescent.services.engine.sampler import SamplingConfig, sample_batch

VOCAB = 64


def reference_logprobs(logits: list[float]) -> list[float]:
    top = max(logits)
    total = sum(math.exp(x - top) for x in logits)
    return [x - top - math.log(total) for x in logits]


def test_logprob_is_the_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(1)
    logits = torch.randn(VOCAB) * 4
    expected = reference_logprobs(logits.tolist())
    for token in (0, 7, VOCAB - 1):
        entry = token_logprob(logits, token, 5)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(expected[token], abs=1e-5)
    ranked = sorted(range(VOCAB), key=lambda t: (-expected[t], t))[:5]
    assert [t for t, _ in token_logprob(logits, 0, 5).top] == ranked
    assert [lp for _, lp in token_logprob(logits, 0, 5).top] == pytest.approx([expected[t] for t in ranked], abs=1e-5)


def test_alternatives_most_likely_first_ties_in_id_order() -> None:
    logprobs = torch.tensor([-3.0, -1.0, -2.0, -1.0, -2.0, -1.0, -5.0])
    assert top_tokens(logprobs, 2) == ((1, -1.0), (3, -1.0))  # three tokens tie for first: the smallest ids win
    assert top_tokens(logprobs, 4) == ((1, -1.0), (3, -1.0), (5, -1.0), (2, -2.0))
    assert top_tokens(logprobs, 0) == ()
    assert len(top_tokens(logprobs, 50)) == 7  # no more alternatives than the vocabulary holds


def test_rules_shape_sampling_but_not_the_reported_numbers() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    plain = sample_batch(logits, [SamplingConfig()], [0])[0]
    biased_cfg = SamplingConfig(logit_bias=((plain, -100.0),), logprobs=3)
    biased = sample_batch(logits, [biased_cfg], [0], [[]])[0]
    assert biased != plain
    entry = batch_logprobs(logits, [biased], [biased_cfg.logprobs])[0]
    assert entry is not None
    assert entry.logprob == pytest.approx(reference_logprobs(logits[0].tolist())[biased], abs=1e-5)
    assert entry.top[0][0] == plain, "the alternatives are the model's, before logit_bias"


def test_a_greedy_token_is_the_first_alternative() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, VOCAB)
    logits[5, 9] = logits[5, 11] = logits[5].max() + 1  # a tie: argmax and the ranking both pick 9
    tokens = sample_batch(logits, [SamplingConfig()] * 8, [0] * 8)
    for entry, token in zip(batch_logprobs(logits, tokens, [2] * 8), tokens):
        assert entry is not None and entry.top[0] == (token, entry.logprob)


def test_only_rows_that_ask_get_entries_and_a_row_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, VOCAB) * 3
    tokens = [3, 1, 4, 1, 5, 9]
    wants = [2, None, 0, 5, None, 20]
    together = batch_logprobs(logits, tokens, wants)
    alone = [batch_logprobs(logits[i:i + 1].clone(), tokens[i:i + 1], wants[i:i + 1])[0] for i in range(6)]
    assert together == alone  # bit for bit
    assert [e is None for e in together] == [k is None for k in wants]
    assert [len(e.top) for e in together if e is not None] == [2, 0, 5, 20]
