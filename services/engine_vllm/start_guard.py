"""SIGTERM/SIGINT while vLLM is still starting.

vLLM's start (load, profile, compile: minutes on a CPU) blocks the instance's event loop, and it
must run there (its zmq asyncio sockets bind to the loop that creates them). The shell's signal
handler only queues a callback on that loop, so a signal would be acted on after the start. For
the start, ``StartGuard`` wraps the process's handlers (installed from the main thread, where
Python runs signal handlers): the first signal stops vLLM's processes at once — its engine core
dies, so vLLM's start raises — and ``StartInterrupted`` ends the instance cleanly. Whatever of
vLLM's processes survive that is killed by the watchdog (``reaper.py``) once the instance exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from crescent.services.engine_vllm.reaper import descendants

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], object] | int | None


class StartInterrupted(Exception):
    """A shutdown signal arrived while vLLM was starting; the instance stops without serving."""


def stop_descendants(sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process this one started (vLLM's engine core and workers; the
    watchdog ignores it). Returns their pids."""
    pids = sorted(descendants(os.getpid()))
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass  # already gone
    return pids


class StartGuard:
    """Installed on the main thread before vLLM starts, removed once it has (``install`` and
    ``remove`` must run there: ``signal.signal`` refuses other threads)."""

    def __init__(self, stop: Callable[[], object] = stop_descendants) -> None:
        self.signalled = threading.Event()
        self._stop = stop
        self._previous: dict[int, Handler] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def remove(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.signalled.is_set():
            self.signalled.set()
            self._stop()  # no logging here: a handler that logs can deadlock on the logging lock
        previous = self._previous.get(signum)
        if callable(previous):  # the shell still hears it: a start that wins the race drains at once
            previous(signum, frame)

    def check(self) -> None:
        """Raise ``StartInterrupted`` if a signal came during the start."""
        if self.signalled.is_set():
            raise StartInterrupted(f"a shutdown signal arrived while vLLM was starting (pid {os.getpid()})")
