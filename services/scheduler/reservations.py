"""What the scheduler promised an instance, request by request, until the instance's own report
covers it.

A placement reserves work on its prefill instance (the tokens it must compute) and KV on its
decode instance (prompt + max_tokens, or the n-choice figure). A reservation is *pending* until the instance lists the
request in a load report: from then on the report's own figures include it. The book keeps such
a request as *held* — never counted again against reported capacity — because what the
scheduler knows of it one by one predicts better than totals: when a decode request frees its
KV, how long each prompt ahead in a prefill queue takes.
A reservation ends when the instance reports the request finished (or no longer lists it), when
the gateway reports it released, or after a timeout — the safety net for lost reports.
A held request the gateway reports finished is still inside the instance's last report (its KV
counted as used, its row as running) until the next report: the book keeps it as *freed* till
then, so a client that sends its next request as its last one ends is not refused for KV that is
already free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class Reservation:
    request_id: str
    tokens: int                  # prefill: tokens to compute; decode: KV tokens (PlacementRequest.decode_kv_tokens)
    prompt_tokens: int           # prefill: tokens - prompt_tokens are cached
    max_tokens: int
    placed_at: float
    ready_in_s: float            # decode: predicted time until the request reaches it (its TTFT)
    held_since: float | None = None  # first listed by the instance
    running_since: float | None = None  # decode: first seen among the instance's running requests
    sequences: int = 1           # decode: batch rows, one per choice


class ReservationBook:
    """One instance's reservations, keyed by request id."""

    def __init__(self, keep_held: bool) -> None:
        self._keep_held = keep_held  # remember held requests (see the module docstring)
        self._entries: dict[str, Reservation] = {}
        self._freed: dict[str, Reservation] = {}  # held, ended, still inside the last report

    def add(self, reservation: Reservation) -> None:
        self._entries[reservation.request_id] = reservation

    def release(self, request_id: str) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.held_since is not None:
            self._freed[request_id] = entry
        return entry is not None

    def apply_report(self, active: Iterable[str], finished: Iterable[str], now: float) -> None:
        """The instance holds ``active`` now and let go of ``finished`` since its last report."""
        active = set(active)
        for request_id in finished:
            self._entries.pop(request_id, None)
        self._freed = {r: e for r, e in self._freed.items() if r in active}  # the others are in the report now
        for request_id, entry in list(self._entries.items()):
            if request_id in active:
                if not self._keep_held:
                    del self._entries[request_id]
                elif entry.held_since is None:
                    entry.held_since = now
            elif entry.held_since is not None:  # held before, gone now: it finished
                del self._entries[request_id]

    def clear_pending(self) -> None:
        """An instance that never reports request ids: its report is taken to cover everything."""
        for request_id in [r for r, e in self._entries.items() if e.held_since is None]:
            del self._entries[request_id]

    def expire(self, deadline: float) -> int:
        """Drop pending reservations placed before ``deadline``; returns how many."""
        old = [r for r, e in self._entries.items() if e.held_since is None and e.placed_at < deadline]
        for request_id in old:
            del self._entries[request_id]
        return len(old)

    def pending(self) -> Iterator[Reservation]:
        return (e for e in self._entries.values() if e.held_since is None)

    def held(self) -> Iterator[Reservation]:
        return (e for e in self._entries.values() if e.held_since is not None)

    def held_in_order(self) -> list[Reservation]:
        """Held requests in the order they reached the instance (a FIFO instance runs them so)."""
        return sorted(self.held(), key=lambda e: (e.held_since or 0.0, e.placed_at))

    def mark_running(self, running: int, now: float) -> None:
        """The instance runs ``running`` requests: in FIFO order, the first ones it holds."""
        for e in self.held_in_order()[:running]:
            if e.running_since is None:
                e.running_since = now

    def pending_totals(self) -> tuple[int, int, int]:
        """(sequences, tokens, prompt tokens per sequence) still pending: a request of n choices
        is n rows of a decode batch, each attending to the prompt."""
        n = tokens = prompt = 0
        for e in self.pending():
            n += e.sequences
            tokens += e.tokens
            prompt += e.prompt_tokens * e.sequences
        return n, tokens, prompt

    def freed_totals(self) -> tuple[int, int]:
        """(sequences, KV tokens) of held requests that ended since the instance's last report."""
        return sum(e.sequences for e in self._freed.values()), sum(e.tokens for e in self._freed.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
