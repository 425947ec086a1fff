"""How ``crescent up`` shares this machine's cores among its engine processes (CPU serving).

Prefill and decode are separate processes, each with its own torch (OpenMP) thread team. When
their teams together want more threads than there are cores, OpenMP's default spin-waiting turns
contention into stalls: a thread spinning at a barrier holds a core that the other process's
thread needs to reach its own barrier. Measured on 2 cores with both engines at 2 threads, a
~900-token prefill beside 4 decoding streams took 3.4–9 s and decode stalled up to 6 s between
tokens; with the split below, 2.3 s and at most 0.25 s (docs/benchmarks.md).

The split: a decode step is many small kernels that gain little from a second thread (46 vs
32 ms per token alone) and suffer most from waiting, so decode takes one core's worth; prefill
is large matmuls that do gain (1.4 vs 2.5 s for ~900 tokens), so it keeps up to two threads,
but when that oversubscribes the cores its threads wait passively (``OMP_WAIT_POLICY=PASSIVE``)
and a decode step never queues behind a spinning prefill thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_THREADS = 2  # per engine: the embedded models gain little beyond this on CPU


@dataclass(frozen=True, slots=True)
class EngineThreads:
    prefill: int          # torch threads per prefill process
    decode: int           # torch threads per decode process
    prefill_passive: bool  # prefill threads sleep rather than spin while waiting

    def env(self, role: str) -> dict[str, str]:
        """What the role's process environment gets (OpenMP reads it at start)."""
        env = {"OMP_NUM_THREADS": str(self.threads(role))}
        if role != "decode" and self.prefill_passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return env

    def threads(self, role: str) -> int:
        """Per process of ``role``: "prefill", "decode", or "aggregated" (counted as prefill)."""
        return self.decode if role == "decode" else self.prefill


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_cores(cores: int, prefill: int, decode: int = 0) -> EngineThreads:
    """Threads per engine for ``prefill`` + ``decode`` engine processes on ``cores`` cores
    (aggregated engines count as prefill ones: bursty prompts, and decode steps of their own)."""
    if cores >= MAX_THREADS * (prefill + decode):  # room for every engine's full team: nothing contends
        return EngineThreads(prefill=MAX_THREADS, decode=MAX_THREADS, prefill_passive=False)
    # Prefill is bursty and decode steady: prefill keeps a full team, which with passive waiting
    # takes only the cores decode leaves idle.
    prefill_threads = min(MAX_THREADS, cores)
    oversubscribed = prefill * prefill_threads + decode > cores
    return EngineThreads(prefill=prefill_threads, decode=1, prefill_passive=oversubscribed)
