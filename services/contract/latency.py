"""Time between tokens (TBT) as Mooncake defines it, for the gateway's metric and the simulator alike.

TBT is the mean of the longest 10% of a request's inter-token intervals (at least one interval).
A request that produced fewer than two tokens has no interval, so it has no TBT: ``None``, not
0 s, which would read as a perfect stream and pull averages down. Whoever aggregates decides what
an absent TBT counts as (the SLO checks count it as met).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def tbt_seconds(intervals: Sequence[float]) -> float | None:
    """Mean of the longest 10% of ``intervals`` (at least one); None without intervals."""
    if not intervals:
        return None
    longest = heapq.nlargest(max(1, math.ceil(len(intervals) * 0.1)), intervals)
    return sum(longest) / len(longest)
