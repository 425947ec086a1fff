"""The natural output length decode requests run, from finished ones some of which were cut off."""

from __future__ import annotations

import math

from crescent.services.scheduler.output_lengths import OutputLengths, natural_length_quantile


def test_without_cut_off_requests_it_is_the_plain_quantile() -> None:
    observations = [(n, True) for n in range(1, 11)]
    assert natural_length_quantile(observations, 0.9) == 9
    assert natural_length_quantile(observations, 0.5) == 5


def test_requests_cut_off_early_do_not_make_longer_ones_look_long() -> None:
    # Health probes of max_tokens 2 reach it; they say only that their natural length is >= 2.
    observations = [(2, False)] * 10 + [(n, True) for n in range(10, 20)]
    assert natural_length_quantile(observations, 0.9) == 18


def test_too_many_cut_off_long_leaves_the_quantile_unknown() -> None:
    # Half of the requests ran to their max_tokens of 128: 10% of them may run much longer.
    observations = [(128, False)] * 10 + [(n, True) for n in range(10, 20)]
    assert natural_length_quantile(observations, 0.9) == math.inf


def test_expected_steps_fall_back_to_max_tokens_until_enough_finished() -> None:
    lengths = OutputLengths(min_samples=8)
    for n in range(7):
        lengths.observe("m", 10 + n, 1024)
    assert lengths.expected_steps("m", 1024) == 1024
    lengths.observe("m", 17, 1024)
    assert lengths.expected_steps("m", 1024) == 17
    assert lengths.expected_steps("m", 12) == 12  # never more than max_tokens
    assert lengths.expected_steps("other", 1024) == 1024  # per model


def test_the_scheduler_settings_set_the_estimate() -> None:
    from crescent.services.scheduler.conductor import Conductor
    from crescent.services.scheduler.config import SchedulerSettings

    lengths = Conductor(SchedulerSettings(output_lengths={"min_samples": 2, "quantile": 0.5})).output_lengths
    lengths.observe("m", 10, 100)
    lengths.observe("m", 30, 100)
    assert lengths.expected_steps("m", 100) == 10
