"""A stream reader that fell behind gets its choice's queued tokens in one event, and nothing that
must stand alone is folded in: an ending, another choice's tokens, an update with words of its own
(an error, the vLLM backend's "this choice ended alone")."""

from __future__ import annotations

from crescent.services.decode.pipeline import coalesced
from crescent.services.decode.request import ERROR, TokenUpdate
from crescent.services.engine_vllm.requests import ChoiceUpdate


def test_a_choices_running_tokens_come_in_one_update_and_its_finish_after() -> None:
    updates = [TokenUpdate((1,), None, index=0), TokenUpdate((2, 3), None, index=0), TokenUpdate((4,), "stop", index=0)]
    assert coalesced(updates) == [TokenUpdate((1, 2, 3, 4), "stop", index=0)]


def test_choices_are_never_mixed_and_an_error_stands_alone() -> None:
    updates = [TokenUpdate((1,), None, index=0), TokenUpdate((7,), None, index=1), TokenUpdate((8,), None, index=1),
               TokenUpdate((), ERROR, "engine failed", index=1)]
    assert coalesced(updates) == [TokenUpdate((1,), None, index=0), TokenUpdate((7, 8), None, index=1),
                                  TokenUpdate((), ERROR, "engine failed", index=1)]


def test_a_vllm_choice_ended_alone_keeps_the_tokens_before_it() -> None:
    ended = ChoiceUpdate(2, (), (), None, "choice ended")  # running, with words: the servicer drops the choice
    updates = [ChoiceUpdate(2, (5,)), ChoiceUpdate(2, (6,)), ended, ChoiceUpdate(2, (9,))]
    assert coalesced(updates) == [ChoiceUpdate(2, (5, 6)), ended, ChoiceUpdate(2, (9,))]
