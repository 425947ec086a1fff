"""The pages a decode instance has promised, request by request.

Every request it holds has a reservation: the KV pages of prompt + max_tokens (within the
context window), all it can ever need. A request is *waiting* until the pages not promised to
admitted requests cover its reservation, *admitted* from then until it ends. The sum over
admitted requests never exceeds the cache, which is why no step can run out of pages; what
the scheduler hears as free is what is promised to nobody, waiting requests included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KvLedger:
    num_pages: int
    page_size: int
    waiting: dict[str, int] = field(default_factory=dict)    # request id → pages it will need
    admitted: dict[str, int] = field(default_factory=dict)   # request id → pages reserved for it

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def admitted_pages(self) -> int:
        return sum(self.admitted.values())

    @property
    def promised_pages(self) -> int:
        return self.admitted_pages + sum(self.waiting.values())

    @property
    def free_tokens(self) -> int:
        """Token slots promised to no request held here."""
        return max(self.num_pages - self.promised_pages, 0) * self.page_size

    def wait(self, request_id: str, reserve_tokens: int) -> None:
        assert request_id not in self.waiting and request_id not in self.admitted, request_id
        self.waiting[request_id] = self.pages_for(reserve_tokens)

    def fits_now(self, request_id: str) -> bool:
        """Whether a waiting request's reservation fits beside the admitted ones."""
        return self.admitted_pages + self.waiting[request_id] <= self.num_pages

    def admit(self, request_id: str) -> None:
        assert self.fits_now(request_id), request_id
        self.admitted[request_id] = self.waiting.pop(request_id)

    def unadmit(self, request_id: str) -> None:
        """Back to waiting (its KV could not be loaded after all)."""
        self.waiting[request_id] = self.admitted.pop(request_id)

    def release(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.admitted.pop(request_id, None)
