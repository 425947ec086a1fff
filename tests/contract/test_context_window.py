"""The context-window fit both completion endpoints apply."""

from __future__ import annotations

import pytest

from crescent.services.contract.context_window import ContextWindowExceeded, completion_budget


def test_a_requested_completion_that_fits_is_kept() -> None:
    assert completion_budget(100, 8192, 50, 256) == 50
    assert completion_budget(100, 150, 50, 256) == 50        # exactly the window


def test_the_default_shrinks_to_what_the_prompt_leaves() -> None:
    assert completion_budget(100, 8192, None, 256) == 256
    assert completion_budget(8000, 8192, None, 256) == 192


def test_a_prompt_without_room_or_a_completion_too_long_is_refused() -> None:
    with pytest.raises(ContextWindowExceeded) as full:
        completion_budget(8192, 8192, None, 256)
    assert full.value.requested is None
    with pytest.raises(ContextWindowExceeded) as long:
        completion_budget(100, 150, 51, 256)
    assert (long.value.prompt_tokens, long.value.window, long.value.requested) == (100, 150, 51)
