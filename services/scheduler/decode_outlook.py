"""When a decode instance's KV will free: a small projection of its FIFO continuous batching.

Decode reserves prompt + max_tokens (more for n choices) for each request's life and admits
waiting requests in order as reservations free; a request that waits is not progressing. So
"when does KV free" depends on the order: the projection runs the known requests through
first-in-first-out admission under the instance's KV room and batch cap, each finishing after
at most max_tokens steps (it may stop earlier: the outlook is on the late side, which keeps
promises).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownRequest:
    kv_tokens: int
    steps_left: float      # decode steps until it finishes once running
    arrives_in_s: float    # 0: already at the instance (held); else predicted handoff
    sequences: int = 1     # batch rows it takes: one per choice


def project_releases(requests: Sequence[KnownRequest], room_tokens: int, max_batch: int,
                     step_s: float) -> list[tuple[float, int]]:
    """(seconds from now, KV tokens) each request frees, soonest first.

    ``requests`` in FIFO order; ``room_tokens``: KV the known requests may use (capacity less
    what requests unknown to the scheduler hold). A request larger than the room blocks the
    queue behind it, as it would on the instance: nothing after it is projected.
    """
    releases: list[tuple[float, int]] = []
    running: list[tuple[float, int, int]] = []  # (finish time, kv, sequences) heap
    rows = 0  # sequences running
    free = room_tokens
    now = 0.0
    i = 0
    while i < len(requests) or running:
        while i < len(requests):  # admit in order while the head has arrived and fits
            head = requests[i]
            # Each choice is a batch row; a request wider than the cap still runs, alone.
            rows_short = max_batch and running and rows + head.sequences > max_batch
            if head.arrives_in_s > now or head.kv_tokens > free or rows_short:
                break
            heapq.heappush(running, (now + max(head.steps_left, 1.0) * step_s, head.kv_tokens, head.sequences))
            free -= head.kv_tokens
            rows += head.sequences
            i += 1
        head_arrival = requests[i].arrives_in_s if i < len(requests) else float("inf")
        if running and running[0][0] <= head_arrival or running and head_arrival <= now:
            now, kv, seqs = heapq.heappop(running)
            free += kv
            rows -= seqs
            releases.append((now, kv))
        elif i < len(requests) and head_arrival > now:
            now = head_arrival
        else:  # the head can never fit: the queue is stuck behind it
            break
    return releases
