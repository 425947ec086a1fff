"""The KV n choices need: the scheduler's tokens and decode's pages are one split, counted two ways."""

from __future__ import annotations

import itertools

from crescent.services.contract.choices import choices_kv_pages, choices_kv_tokens, reserve_tokens


def test_one_choice_needs_prompt_plus_max_tokens() -> None:
    assert choices_kv_tokens(100, 50, 1, 64) == 150
    assert choices_kv_tokens(100, 50, 0, 64) == 150          # n 0 is one choice
    assert choices_kv_pages(100, 150, 1, 64) == 3             # 150 tokens in 64-token pages


def test_further_choices_share_the_prompts_full_blocks() -> None:
    # 100-token prompt: one full block (64) shared, each choice owns 36 + 50 tokens
    assert choices_kv_tokens(100, 50, 3, 64) == 64 + 3 * 86
    assert choices_kv_pages(100, 150, 3, 64) == 1 + 3 * 2


def test_pages_are_the_token_count_rounded_up_per_choice() -> None:
    for prompt, out, n, block in itertools.product((1, 63, 64, 65, 300), (1, 16, 200), (1, 2, 5), (4, 16, 64)):
        tokens = choices_kv_tokens(prompt, out, n, block)
        pages = choices_kv_pages(prompt, prompt + out, n, block)
        assert tokens <= pages * block < tokens + n * block, (prompt, out, n, block)


def test_the_reservation_stops_at_the_context_window() -> None:
    assert reserve_tokens(100, 50, 8192) == 150
    assert reserve_tokens(8000, 500, 8192) == 8192
