"""Time between tokens: one definition for the gateway's metric and the simulator."""

from __future__ import annotations

import pytest

from crescent.services.contract.latency import tbt_seconds


def test_tbt_is_the_mean_of_the_longest_tenth() -> None:
    assert tbt_seconds([0.5]) == 0.5
    assert tbt_seconds([0.01] * 90 + [0.5] * 10) == pytest.approx(0.5)
    assert tbt_seconds([0.1] * 18 + [1.0, 0.5]) == pytest.approx(0.75)


def test_no_interval_has_no_tbt_rather_than_a_perfect_one() -> None:
    # One token (or none) has no interval: None, which aggregations count as meeting the SLO,
    # instead of 0 s, which would drag averages towards a stream that never happened.
    assert tbt_seconds([]) is None
