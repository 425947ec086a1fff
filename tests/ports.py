"""Loopback ports for the servers tests start."""

from __future__ import annotations

from crescent.services.common.ports import unused_port

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never handed out before in this run, outside the range
    the kernel gives outgoing connections (so no client socket can take it before the server
    binds)."""
    return unused_port("127.0.0.1", _HANDED_OUT)
