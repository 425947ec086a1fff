"""Which KDA state snapshots should a hybrid (Kimi K3) prefix cache keep? A replay of a multi-turn
Mooncake trace through a model of ``K3Cache``'s policies.

The cache modelled is the engine's (services/engine/kimi_k3/cache.py): MLA latents of every cached
block in an LRU of ``--cache-tokens`` tokens, and KDA state snapshots in an LRU pool of
``--snapshots`` slots, kept at the block boundaries the policy names; a block whose latents are
evicted loses its snapshot. A request matches its longest cached prefix of whole blocks (at most
the blocks before its last token, as the engine does), resumes from the last snapshot at or
below the match, recomputes the rest, and then caches its own blocks and the policy's snapshots.
Blocks are the trace's (512 tokens; ``hash_ids`` name a block and its whole prefix).

Policies: every block (k = 1), every k-th block, turn ends only (k = 0: the end of each prompt's
last full block — where the next turn of its conversation resumes). Bytes are the full K3 shape's
(``K3_FULL``: 27,648 B of bf16 latents per token, 449 MB per state snapshot).

    python loadtest/bench_k3_snapshots.py [--trace PATH] [--limit N] [--cache-tokens T] [--snapshots S]

Prints, per policy: the prefix hit ratio (tokens resumed / prompt tokens), the hit ratio a cache
with a snapshot at every block and unbounded snapshots would reach (the latents' own limit), and
the cache bytes per cached token (latents + snapshots held, averaged over the replay).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crescent.services.engine.kimi_k3 import K3_FULL, k3_footprint  # noqa: E402
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy  # noqa: E402
from loadtest.simulator.trace import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, TraceRequest, load_trace  # noqa: E402


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    every: int  # k: a snapshot after every k-th block; 0: turn ends only

    def wants(self, block: int, input_length: int) -> bool:
        """The engine's own rule (``SnapshotPolicy.wants``) at the trace's block size."""
        return SnapshotPolicy(every_blocks=self.every).wants(block, input_length, TRACE_BLOCK_TOKENS)


@dataclass(slots=True)
class Result:
    policy: Policy
    prompt_tokens: int = 0
    hit_tokens: int = 0
    latent_hit_tokens: int = 0  # what the latents alone would give (a snapshot at every block, no bound)
    byte_samples: float = 0.0
    token_samples: float = 0.0
    snapshots_taken: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens

    @property
    def latent_hit_ratio(self) -> float:
        return self.latent_hit_tokens / self.prompt_tokens

    @property
    def bytes_per_cached_token(self) -> float:
        return self.byte_samples / self.token_samples


class CacheModel:
    """Latents in an LRU of blocks; snapshots in an LRU pool; a block evicted loses its snapshot."""

    def __init__(self, block_capacity: int, snapshot_slots: int) -> None:
        """``snapshot_slots`` < 0: no bound."""
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.snaps: OrderedDict[int, None] = OrderedDict()
        self.block_capacity, self.snapshot_slots = block_capacity, snapshot_slots

    def match(self, ids: tuple[int, ...], usable: int) -> tuple[int, int]:
        """(blocks matched, blocks resumable: up to the last snapshot in the match)."""
        matched = 0
        while matched < usable and ids[matched] in self.blocks:
            matched += 1
        resumed = matched
        while resumed and ids[resumed - 1] not in self.snaps:
            resumed -= 1
        if resumed:
            self.snaps.move_to_end(ids[resumed - 1])
        return matched, resumed

    def store(self, ids: tuple[int, ...], full: int, snapshot_blocks: list[int]) -> int:
        for h in ids[:full]:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
            while len(self.blocks) > self.block_capacity:
                old, _ = self.blocks.popitem(last=False)
                self.snaps.pop(old, None)
        taken = 0
        for b in snapshot_blocks:
            if self.snapshot_slots != 0 and ids[b] in self.blocks:
                self.snaps[ids[b]] = None
                self.snaps.move_to_end(ids[b])
                taken += 1
                while 0 < self.snapshot_slots < len(self.snaps):
                    self.snaps.popitem(last=False)
        return taken


def replay(trace: list[TraceRequest], policy: Policy, cache_tokens: int, snapshot_slots: int,
           token_bytes: int, state_bytes: int) -> Result:
    cache = CacheModel(cache_tokens // TRACE_BLOCK_TOKENS, snapshot_slots)
    result = Result(policy)
    for req in trace:
        full = min(req.input_length // TRACE_BLOCK_TOKENS, len(req.hash_ids))
        usable = min((req.input_length - 1) // TRACE_BLOCK_TOKENS, len(req.hash_ids))
        matched, resumed = cache.match(req.hash_ids, usable)
        result.prompt_tokens += req.input_length
        result.hit_tokens += resumed * TRACE_BLOCK_TOKENS
        result.latent_hit_tokens += matched * TRACE_BLOCK_TOKENS
        # the blocks computed now (after the resumed ones) take the policy's snapshots
        wanted = [b for b in range(resumed, full) if policy.wants(b, req.input_length)]
        result.snapshots_taken += cache.store(req.hash_ids, full, wanted)
        tokens = len(cache.blocks) * TRACE_BLOCK_TOKENS
        result.token_samples += tokens
        result.byte_samples += tokens * token_bytes + len(cache.snaps) * state_bytes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--cache-tokens", type=int, default=4 << 20, help="latent cache size in tokens (4M)")
    parser.add_argument("--snapshots", type=int, nargs="+", default=[64, 256, 1024, -1],
                        help="snapshot pool sizes to try (-1: unbounded, the old one-state-per-block layout)")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16, 0],
                        help="policies: k for every k-th block, 0 for turn ends only")
    args = parser.parse_args()
    trace = load_trace(args.trace, args.limit)
    fp = k3_footprint(K3_FULL)
    start = time.perf_counter()
    print(f"trace {Path(args.trace).name}: {len(trace)} requests, "
          f"{sum(r.input_length for r in trace) / len(trace):,.0f} prompt tokens on average; "
          f"blocks of {TRACE_BLOCK_TOKENS} tokens; latents {args.cache_tokens:,} tokens "
          f"({args.cache_tokens * fp.kv_bytes_per_token / 1e9:.1f} GB); "
          f"{fp.snapshot_bytes_per_block / 1e6:.0f} MB per snapshot; full K3 bytes")
    print(f"{'policy':<18} {'slots':>9} {'hit ratio':>9} {'latents alone':>13} {'snapshots taken':>15} "
          f"{'B / cached token':>16}")
    for slots in args.snapshots:
        for k in args.every:
            policy = Policy("turn ends only" if k == 0 else "every block" if k == 1 else f"every {k}th block", k)
            r = replay(trace, policy, args.cache_tokens, slots, fp.kv_bytes_per_token, fp.snapshot_bytes_per_block)
            print(f"{policy.name:<18} {slots if slots >= 0 else 'unbounded':>9} {r.hit_ratio:>9.3f} "
                  f"{r.latent_hit_ratio:>13.3f} {r.snapshots_taken:>15,} {r.bytes_per_cached_token:>16,.0f}")
    print(f"({time.perf_counter() - start:.1f} s on {platform.machine()}, Python {platform.python_version()})")


if __name__ == "__main__":
    main()
