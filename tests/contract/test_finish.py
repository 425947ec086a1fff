"""The finish rule every service applies: stop beats length, length counts tokens and the window."""

from __future__ import annotations

from crescent.services.contract.finish import finish_reason, stop_token_ids

EOS = (2,)


def test_the_stop_set_adds_end_of_sequence_unless_ignored() -> None:
    assert stop_token_ids([7], EOS, ignore_eos=False) == {7, 2}
    assert stop_token_ids([7], EOS, ignore_eos=True) == {7}
    assert stop_token_ids([], EOS, ignore_eos=True) == frozenset()


def test_a_stop_token_ends_with_stop_even_on_the_last_allowed_token() -> None:
    stops = stop_token_ids([], EOS, ignore_eos=False)
    assert finish_reason(2, 1, 1, stops) == "stop"
    assert finish_reason(2, 5, 16, stops) == "stop"


def test_max_tokens_ends_with_length_and_fewer_go_on() -> None:
    stops = frozenset(EOS)
    assert finish_reason(9, 1, 1, stops) == "length"      # prefill's first token with max_tokens 1
    assert finish_reason(9, 1, 0, stops) == "length"      # max_tokens 0 still yields one token
    assert finish_reason(9, 3, 4, stops) is None
    assert finish_reason(9, 4, 4, stops) == "length"


def test_a_full_context_window_ends_with_length() -> None:
    stops = frozenset(EOS)
    assert finish_reason(9, 1, 100, stops, context_tokens=8191, context_window=8192) is None
    assert finish_reason(9, 1, 100, stops, context_tokens=8192, context_window=8192) == "length"
    assert finish_reason(9, 1, 100, stops, context_tokens=10**6) is None  # no window given: not checked
