"""Pure pieces of the gateway: stop strings over streamed text and the TBT statistic."""

from __future__ import annotations

import pytest
from crescent.services.contract.latency import tbt_seconds
from crescent.services.gateway.stop_strings import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    released = []
    for piece in pieces:
        scan = matcher.push(piece)
        released.append(scan.text)
        if scan.stopped:
            return released, True
    released.append(matcher.flush())
    return released, False


def test_text_without_stop_strings_passes_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_possible_start_of_a_stop_string_is_held_back() -> None:
    released, stopped = run(["END"], ["abc E", "N", "x"])
    assert released == ["abc ", "", "ENx", ""] and not stopped


def test_stop_string_across_pieces_truncates_before_it() -> None:
    released, stopped = run(["lo w"], ["he", "ll", "o ", "wo", "rl"])
    assert "".join(released) == "hel" and stopped


def test_earliest_stop_string_wins() -> None:
    released, stopped = run(["cd", "b"], ["abcd"])
    assert released == ["a"] and stopped


def test_held_back_tail_is_released_at_the_end() -> None:
    released, stopped = run(["near"], ["the end is ", "nea"])
    assert "".join(released) == "the end is nea" and not stopped


def test_overlapping_partial_matches() -> None:
    released, stopped = run(["aab"], ["a", "a", "a", "b", "c"])
    assert "".join(released) == "a" and stopped


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_tbt_is_the_mean_of_the_longest_tenth() -> None:
    assert tbt_seconds([]) is None
    assert tbt_seconds([0.5]) == 0.5
    intervals = [0.01] * 18 + [0.3, 0.5]
    assert tbt_seconds(intervals) == pytest.approx(0.4)
    assert tbt_seconds([0.1] * 5 + [0.9] * 1 + [0.2] * 5) == pytest.approx((0.9 + 0.2) / 2)
