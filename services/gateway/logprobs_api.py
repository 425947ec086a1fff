"""The HTTP shapes of reported log-probabilities (docs/logprobs.md).

Chat (``choices[i].logprobs``, and each streamed chunk's): ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, as OpenAI's chat API.
Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
"""

from __future__ import annotations

from pydantic import BaseModel


class TopLogprob(BaseModel):
    token: str              # the token's text as its bytes decode alone (U+FFFD for part of a character)
    logprob: float
    bytes: list[int] | None  # the token's raw UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the k most likely tokens, and always the sampled one
    text_offset: list[int]                # where each token's text starts in the choice's text
