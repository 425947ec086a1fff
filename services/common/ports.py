"""Picking a port for a server that a parent process starts and then tells where to listen.

Asking the OS for port 0 and closing the socket hands back a port from the ephemeral range,
which the kernel gives to the next outgoing connection as well: on a busy machine a gRPC
client's source port took the one a child was about to bind (CI, 2026-12-05). Ports below the
ephemeral range are only ever taken by an explicit bind, so pick there.

``CRESCENT_PORT_RANGE=LOW-HIGH`` (inclusive) narrows the picks to a slice of that range, for
several launchers on one machine that must never pick the same port: the test suite gives each
of its pytest workers its own slice (tests/conftest.py), and the ``crescent up`` stacks a worker
starts inherit it.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # clear of the well-known and registered ports most daemons use
_RANGE_WIDTH = 20_000
PORT_RANGE_ENV = "CRESCENT_PORT_RANGE"


def _candidate_range() -> range:
    narrowed = os.environ.get(PORT_RANGE_ENV, "").strip()
    return _parse_range(narrowed) if narrowed else _default_range()


def _default_range() -> range:
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768  # Linux's default
    high = max(ephemeral_low, _LOWEST + 1_000)
    return range(max(_LOWEST, high - _RANGE_WIDTH), high)


def _parse_range(text: str) -> range:
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        first, last = 0, -1
    if not sep or not 1024 <= first <= last <= 65_535:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH, two ports 1024-65535 with LOW <= HIGH")
    return range(first, last + 1)


def worker_port_range(worker: int, workers: int) -> str:
    """Worker ``worker`` (0-based) of ``workers``' slice of the usual range, as ``LOW-HIGH``."""
    candidates = _default_range()
    width = len(candidates) // workers
    low = candidates.start + worker * width
    return f"{low}-{low + width - 1}"


def unused_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A port below the ephemeral range (or in ``CRESCENT_PORT_RANGE``) that nothing listens on
    now and `taken` does not hold.

    The port goes into `taken`, so callers that pick several before starting anything never
    get the same one twice.
    """
    taken = taken if taken is not None else set()
    candidates = _candidate_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(candidates)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1} after 200 tries")
