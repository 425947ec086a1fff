"""Eviction policies, looked up by name.

A policy only orders keys; the tier owns the bytes and the store owns leases. ``pop_victim``
removes and returns the next key to evict, skipping keys for which ``pinned`` is true (leased
blocks are never evicted); it returns None when every key is pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from crescent.services.contract.block_keys import BlockKey

Pinned = Callable[[BlockKey], bool]


class EvictionPolicy(Protocol):
    def insert(self, key: BlockKey) -> None: ...
    def touch(self, key: BlockKey) -> None: ...
    def discard(self, key: BlockKey) -> None: ...
    def pop_victim(self, pinned: Pinned) -> BlockKey | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def keep_order(self) -> list[BlockKey]: ...


class LruPolicy:
    """Least recently used first. O(1) insert/touch/discard; a victim scan skips pinned keys."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def keep_order(self) -> list[BlockKey]:
        """Every key, the one this policy would evict last first."""
        return list(reversed(self._order))

    def pop_victim(self, pinned: Pinned) -> BlockKey | None:
        for key in self._order:
            if not pinned(key):
                del self._order[key]
                return key
        return None


class S3FifoPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO (10%), a main FIFO and a ghost
    FIFO of recently evicted keys. One-hit wonders (a prompt seen once) leave through the small
    queue without displacing blocks that were read again, which LRU cannot tell apart."""

    MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1) -> None:
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._freq: dict[BlockKey, int] = {}
        self._small_fraction = small_fraction

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def insert(self, key: BlockKey) -> None:
        self.discard(key)
        self._freq[key] = 0
        if self._ghost.pop(key, "absent") is None:
            self._main[key] = None  # seen recently enough to be remembered: skip probation
        else:
            self._small[key] = None

    def touch(self, key: BlockKey) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def discard(self, key: BlockKey) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)
        self._freq.pop(key, None)

    def keep_order(self) -> list[BlockKey]:
        """Every key, roughly the one evicted last first: the main queue before probation, and
        within each, read more often before newer before older."""
        def ranked(queue: OrderedDict[BlockKey, None]) -> list[BlockKey]:
            newest_first = list(reversed(queue))
            return sorted(newest_first, key=lambda k: -self._freq.get(k, 0))  # stable: recency breaks ties
        return ranked(self._main) + ranked(self._small)

    def _remember(self, key: BlockKey) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(len(self._main), 16):
            self._ghost.popitem(last=False)

    def pop_victim(self, pinned: Pinned) -> BlockKey | None:
        # Each key is looked at a bounded number of times: a pass moves or re-queues it,
        # and frequencies only go down, so 2 x (MAX_FREQ + 1) x size steps always suffice.
        budget = 2 * (self.MAX_FREQ + 1) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            small_target = max(1, int(self._small_fraction * len(self)))
            if self._small and (len(self._small) >= small_target or not self._main):
                key, _ = self._small.popitem(last=False)
                if self._freq.get(key, 0) > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                elif pinned(key):
                    self._small[key] = None
                    if all(pinned(k) for k in self._small) and (not self._main or all(pinned(k) for k in self._main)):
                        return None
                else:
                    self._freq.pop(key, None)
                    self._remember(key)
                    return key
            else:
                key, _ = self._main.popitem(last=False)
                freq = self._freq.get(key, 0)
                if freq > 0 or pinned(key):
                    self._freq[key] = max(freq - 1, 0)
                    self._main[key] = None
                    if not self._small and all(pinned(k) for k in self._main):
                        return None
                else:
                    self._freq.pop(key, None)
                    return key
        return None


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LruPolicy, "s3fifo": S3FifoPolicy}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_eviction_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; a ValueError lists the valid names."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(policy_names())}")
    return factory()
