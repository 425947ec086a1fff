"""Which tokens' log-probabilities a client gets, and when (docs/logprobs.md).

The backend sends an entry with every token. The client gets one for each token whose text it
receives, in order, no more and no less:

- the end-of-turn token adds no text, so it has no entry;
- stop strings hold text back until it cannot start one: a token's entry goes out with the first
  text of it that is released (before that text, so a stream can put both in one chunk);
- when a stop string cuts the reply, tokens that start inside the stop string (their text is
  dropped) have no entry; a token that starts before it keeps its entry;
- a token that adds no text by itself (part of a UTF-8 character) goes out with the text that
  completes it.

``text_offset`` is where a token's text starts in the generated text (legacy completions report
it). Log-probabilities that underflow to minus infinity are reported as -9999.0, as vLLM does:
JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from crescent.services.gateway.backend import TokenLogprob
from crescent.services.gateway.logprobs_api import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class TokenText:
    token_id: int
    text: str      # its bytes decoded alone (U+FFFD where they hold part of a character)
    raw: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class ReportedToken:
    token: TokenText
    top: tuple[TokenText, ...]  # most likely first
    text_offset: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generation event: entries of tokens whose text is released next (or was, at the end)."""

    entries: tuple[ReportedToken, ...]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


class LogprobTracker:
    """Holds entries until their text is released (see the module docstring)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._pending: list[ReportedToken] = []
        self._generated = 0  # characters of text the detokenizer produced
        self._released = 0   # of them, what the stop-string matcher let through

    def _text(self, token_id: int, logprob: float) -> TokenText:
        raw = self._token_bytes(token_id)
        return TokenText(token_id, raw.decode("utf-8", errors="replace"), raw, _finite(logprob))

    def generated(self, entry: TokenLogprob, text: str) -> None:
        """A token the client may see, and the text the detokenizer produced for it."""
        top = tuple(self._text(t, lp) for t, lp in entry.top)
        self._pending.append(ReportedToken(self._text(entry.token_id, entry.logprob), top, self._generated))
        self._generated += len(text)

    def released(self, text: str) -> TokenLogprobs | None:
        """Entries of the tokens with text in what was just released (None: no new entry)."""
        self._released += len(text)
        ready = 0
        while ready < len(self._pending) and self._pending[ready].text_offset < self._released:
            ready += 1
        return self._take(ready)

    def flush(self) -> TokenLogprobs | None:
        """Generation ended without a stop string: every entry still held."""
        return self._take(len(self._pending))

    def _take(self, count: int) -> TokenLogprobs | None:
        if count == 0:
            return None
        taken, self._pending = self._pending[:count], self._pending[count:]
        return TokenLogprobs(tuple(taken))


def _top(token: TokenText) -> TopLogprob:
    return TopLogprob(token=token.text, logprob=token.logprob, bytes=list(token.raw))


def chat_logprobs(entries: list[ReportedToken]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token.text, logprob=e.token.logprob, bytes=list(e.token.raw),
                         top_logprobs=[_top(t) for t in e.top])
        for e in entries
    ])


def completion_logprobs(entries: list[ReportedToken]) -> CompletionLogprobs:
    """Legacy shape: each alternatives dict holds the k most likely tokens and the sampled one."""
    tops = []
    for e in entries:
        alternatives = {t.text: t.logprob for t in reversed(e.top)}  # the most likely wins a shared text
        alternatives.setdefault(e.token.text, e.token.logprob)
        tops.append(dict(sorted(alternatives.items(), key=lambda kv: -kv[1])))
    return CompletionLogprobs(
        tokens=[e.token.text for e in entries],
        token_logprobs=[e.token.logprob for e in entries],
        top_logprobs=tops,
        text_offset=[e.text_offset for e in entries],
    )
