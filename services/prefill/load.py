"""What a prefill instance reports to the scheduler as its load: requests and prompt tokens waiting.

The scheduler predicts a new request's queueing delay from ``queued_tokens``: prompt tokens
that still have to be computed on this instance (the prompt in progress included). Tokens
found in a cache are not work, so a request's count drops once its prefix is attached.

It also hears which requests the instance holds (a Prefill call is open: computing, or handing
off to decode) and which left since the last report, so it can retire what it reserved for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillLoad:
    on_change: Callable[[], object] = lambda: None  # a request arrived or left: report soon
    _waiting: dict[str, int] = field(default_factory=dict)   # request id → tokens to compute
    _computing: set[str] = field(default_factory=set)
    _held: set[str] = field(default_factory=set)             # every request whose call is open
    _left: list[str] = field(default_factory=list)           # left since the last report

    def admit(self, request_id: str, prompt_tokens: int) -> None:
        self._waiting[request_id] = prompt_tokens
        self._held.add(request_id)
        self.on_change()

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

    def left(self, request_id: str) -> None:
        """The request's call ended (handed off, finished at its first token, failed or cancelled)."""
        self.done(request_id)
        if request_id in self._held:
            self._held.discard(request_id)
            self._left.append(request_id)
            self.on_change()

    @property
    def held(self) -> int:
        return len(self._held)

    def report(self) -> tuple[int, int, int]:
        """(queued requests, prompt tokens still to compute, requests computing now)."""
        running = len(self._computing)
        return len(self._waiting) - running, sum(self._waiting.values()), running

    def active_ids(self) -> list[str]:
        return sorted(self._held)

    def drain_left(self) -> list[str]:
        """The ids that left since the last call."""
        left, self._left = self._left, []
        return left
