"""The global prefix index: which KV block lives on which source, in which tier.

Fed by "block stored / removed" events from engines and kvstore nodes. A lookup walks the
prompt's block keys in order and stops at the first key nobody holds, so its cost is
proportional to the matched prefix, not to the index size.

Memory stays bounded: each key maps to one int that packs a 3-bit tier per source slot, and
when ``max_blocks`` is reached the least recently stored keys are forgotten. Forgetting (like
an empty index after a restart) only makes the scheduler underestimate hits, so it can cost
time but never a wrong answer: the engine re-checks every block it loads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from crescent.services.contract.block_keys import BlockKey
from crescent.services.scheduler.datatypes import PrefixMatch, SourceId, Tier

log = logging.getLogger(__name__)

_BITS = 3
_SLOT_MASK = (1 << _BITS) - 1
_TIERS = {int(t): t for t in Tier}  # Tier(n) is slow on a hot path


class PrefixIndex:
    def __init__(self, max_blocks: int = 4_000_000) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._entries: OrderedDict[BlockKey, int] = OrderedDict()
        self._slot_of: dict[SourceId, int] = {}
        self._source_at: dict[int, SourceId] = {}
        self._free_slots: list[int] = []
        self._keys_of: dict[SourceId, set[BlockKey]] = {}
        self._presence_low = 0  # bit 0 of every used slot: turns packed tiers into a presence mask

    # ---- updates ---------------------------------------------------------------------------

    def store(self, source: str, keys: Iterable[BlockKey], tier: Tier = Tier.ENGINE) -> None:
        slot = self._slot(SourceId(source))
        shift = slot * _BITS
        clear = ~(_SLOT_MASK << shift)
        bits = int(tier) << shift
        owned = self._keys_of[SourceId(source)]
        entries = self._entries
        for key in keys:
            packed = entries.get(key)
            if packed is None:
                entries[key] = bits
            else:
                entries[key] = (packed & clear) | bits
                entries.move_to_end(key)
            owned.add(key)
        self._enforce_bound()

    def remove(self, source: str, keys: Iterable[BlockKey]) -> None:
        slot = self._slot_of.get(SourceId(source))
        if slot is None:
            return
        keys = list(keys)
        self._keys_of[SourceId(source)].difference_update(keys)
        self._clear_slot(slot, keys)

    def replace_source(self, source: str, keys: Iterable[tuple[BlockKey, Tier]]) -> None:
        """A full snapshot: ``keys`` is everything ``source`` holds now."""
        self.drop_source(source)
        by_tier: dict[Tier, list[BlockKey]] = {}
        for key, tier in keys:
            by_tier.setdefault(tier, []).append(key)
        self._slot(SourceId(source))
        for tier, tier_keys in by_tier.items():
            self.store(source, tier_keys, tier)

    def drop_source(self, source: str) -> None:
        """Forget everything ``source`` holds (it died or will send a snapshot)."""
        src = SourceId(source)
        slot = self._slot_of.pop(src, None)
        if slot is None:
            return
        self._clear_slot(slot, self._keys_of.pop(src))
        del self._source_at[slot]
        self._free_slots.append(slot)
        self._presence_low &= ~(1 << (slot * _BITS))

    def _clear_slot(self, slot: int, keys: Iterable[BlockKey]) -> None:
        clear = ~(_SLOT_MASK << (slot * _BITS))
        for key in keys:
            packed = self._entries.get(key)
            if packed is None:
                continue
            packed &= clear
            if packed:
                self._entries[key] = packed
            else:
                del self._entries[key]

    # ---- queries ---------------------------------------------------------------------------

    def match(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        """Leading blocks of ``keys`` held by each source."""
        result = PrefixMatch()
        entries = self._entries
        low = self._presence_low
        alive = -1  # every slot
        for i, key in enumerate(keys):
            packed = entries.get(key)
            if packed is None:
                self._close(result, alive & low, i)
                return result
            present = (packed | (packed >> 1) | (packed >> 2)) & low
            ended = alive & low & ~present
            if ended:
                self._close(result, ended, i)
            alive &= present
            if not alive:
                return result
        self._close(result, alive & low, len(keys))
        return result

    def tiers(self, source: str, keys: Sequence[BlockKey]) -> list[Tier]:
        """The tier of each of ``keys`` on ``source`` (all must be held there)."""
        shift = self._slot_of[SourceId(source)] * _BITS
        entries = self._entries
        return [_TIERS[(entries[k] >> shift) & _SLOT_MASK] for k in keys]

    def holders(self, key: BlockKey) -> dict[SourceId, Tier]:
        packed = self._entries.get(key, 0)
        return {
            src: Tier((packed >> (slot * _BITS)) & _SLOT_MASK)
            for slot, src in self._source_at.items()
            if (packed >> (slot * _BITS)) & _SLOT_MASK
        }

    def __len__(self) -> int:
        return len(self._entries)

    def blocks_of(self, source: str) -> int:
        return len(self._keys_of.get(SourceId(source), ()))

    def sources(self) -> list[SourceId]:
        return list(self._slot_of)

    # ---- internals -------------------------------------------------------------------------

    def _close(self, result: PrefixMatch, slots_mask: int, length: int) -> None:
        if length == 0 or not slots_mask:
            return
        for slot, src in self._source_at.items():
            if slots_mask >> (slot * _BITS) & 1:
                result.by_source[src] = length

    def _slot(self, source: SourceId) -> int:
        slot = self._slot_of.get(source)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[source] = slot
            self._source_at[slot] = source
            self._keys_of[source] = set()
            self._presence_low |= 1 << (slot * _BITS)
        return slot

    def _enforce_bound(self) -> None:
        excess = len(self._entries) - self.max_blocks
        if excess <= 0:
            return
        for _ in range(excess):
            key, packed = self._entries.popitem(last=False)
            for slot, src in self._source_at.items():
                if (packed >> (slot * _BITS)) & _SLOT_MASK:
                    self._keys_of[src].discard(key)
        log.debug("prefix index full: forgot %d oldest blocks", excess)
