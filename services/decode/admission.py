"""The pages a decode instance has promised, request by request.

Every request it holds has a reservation: the KV pages of prompt + max_tokens (within the
context window), all it can ever need. A request is *waiting* until the pages not promised to
admitted requests cover its reservation, *admitted* from then until it ends. The sum over
admitted requests never exceeds the cache, which is why no step can run out of pages; what
the scheduler hears as free is what is promised to nobody, waiting requests included.

A request of ``n`` choices reserves the prompt's full pages once and each choice's own pages
(its copy of the last partial page and its output); a choice that ends early gives its own back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crescent.services.contract.choices import choice_own_pages, choices_kv_pages


@dataclass(slots=True)
class KvLedger:
    num_pages: int
    block_size: int
    waiting: dict[str, int] = field(default_factory=dict)    # request id → pages it will need
    admitted: dict[str, int] = field(default_factory=dict)   # request id → pages reserved for it

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def own_pages(self, prompt_tokens: int, reserve_tokens: int) -> int:
        """Pages one of several choices holds alone: all it may need but the prompt's full pages."""
        return choice_own_pages(prompt_tokens, reserve_tokens, self.block_size)

    def pages_for_choices(self, prompt_tokens: int, reserve_tokens: int, choices: int) -> int:
        """Pages ``choices`` sequences of one prompt may ever hold, each up to ``reserve_tokens``."""
        return choices_kv_pages(prompt_tokens, reserve_tokens, choices, self.block_size)

    @property
    def admitted_pages(self) -> int:
        return sum(self.admitted.values())

    @property
    def promised_pages(self) -> int:
        return self.admitted_pages + sum(self.waiting.values())

    @property
    def free_tokens(self) -> int:
        """Token slots promised to no request held here."""
        return max(self.num_pages - self.promised_pages, 0) * self.block_size

    def wait(self, request_id: str, pages: int) -> None:
        assert request_id not in self.waiting and request_id not in self.admitted, request_id
        self.waiting[request_id] = pages

    def shrink(self, request_id: str, pages: int) -> None:
        """Part of a request's reservation goes back (one of its choices ended)."""
        held = self.admitted if request_id in self.admitted else self.waiting
        assert held.get(request_id, 0) >= pages, (request_id, pages)
        held[request_id] -= pages

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
