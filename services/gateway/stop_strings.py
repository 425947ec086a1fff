"""Stop strings over streamed text.

Text is released as soon as it cannot be the start of a stop string; a tail that might still
grow into one is held back. When a stop string appears, the text before it is released and
the rest (the stop string and anything after it) is dropped, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopScan:
    text: str        # safe to send now
    stopped: bool    # a stop string was found; generation must end


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._pending = ""
        self._stopped = False

    def push(self, text: str) -> StopScan:
        """Add newly generated text; return what may be sent and whether to stop."""
        if self._stopped:
            raise RuntimeError("push after a stop string was found")
        if not self._stops:
            return StopScan(text, False)
        # Released text never holds the start of a stop string, so searching the pending tail suffices.
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            released, self._pending, self._stopped = self._pending[:cut], "", True
            return StopScan(released, True)
        hold = self._longest_partial_suffix()
        released = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return StopScan(released, False)

    def flush(self) -> str:
        """At the end of generation, release the held-back tail (it never became a stop string)."""
        tail, self._pending = self._pending, ""
        return tail

    def _longest_partial_suffix(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
