"""Whether a prompt and its completion fit the model's context window, and how long a completion may be.

A prompt must leave room for at least one token. A requested ``max_tokens`` must fit beside the
prompt, or the request is refused (clients asked for that many); without one, the default
shrinks to what is left. Chat and text completions apply this one rule; the gateway turns a
refusal into its 400 ``context_length_exceeded``.
"""

from __future__ import annotations


class ContextWindowExceeded(Exception):
    """The prompt leaves no room (``requested`` None) or the requested completion does not fit."""

    def __init__(self, prompt_tokens: int, window: int, requested: int | None) -> None:
        super().__init__(f"{prompt_tokens} prompt tokens + {requested or 'any'} completion tokens > {window}")
        self.prompt_tokens = prompt_tokens
        self.window = window
        self.requested = requested


def completion_budget(prompt_tokens: int, window: int, requested: int | None, default: int) -> int:
    """The completion's max_tokens: ``requested`` if it fits, else ``default`` shrunk to fit."""
    if prompt_tokens >= window:
        raise ContextWindowExceeded(prompt_tokens, window, None)
    if requested is None:
        return min(default, window - prompt_tokens)
    if prompt_tokens + requested > window:
        raise ContextWindowExceeded(prompt_tokens, window, requested)
    return requested
