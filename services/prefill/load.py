"""What a prefill instance reports to the scheduler as its load: requests and prompt tokens waiting.

The scheduler predicts a new request's queueing delay from ``queued_tokens``: prompt tokens
that still have to be computed on this instance (the prompt in progress included). Tokens
found in a cache are not work, so a request's count drops once its prefix is attached.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillLoad:
    _waiting: dict[str, int] = field(default_factory=dict)   # request id → tokens to compute
    _computing: set[str] = field(default_factory=set)

    def admit(self, request_id: str, prompt_tokens: int) -> None:
        self._waiting[request_id] = prompt_tokens

    def cached(self, request_id: str, cached_tokens: int) -> None:
        """The request's prefix is attached: only the rest is work."""
        if request_id in self._waiting:
            self._waiting[request_id] = max(self._waiting[request_id] - cached_tokens, 0)

    def computing(self, request_id: str) -> None:
        self._computing.add(request_id)

    def done(self, request_id: str) -> None:
        """Prefill finished (or the request ended): nothing left to compute here."""
        self._waiting.pop(request_id, None)
        self._computing.discard(request_id)

    def report(self) -> tuple[int, int, int]:
        """(queued requests, prompt tokens still to compute, requests computing now)."""
        running = len(self._computing)
        return len(self._waiting) - running, sum(self._waiting.values()), running
