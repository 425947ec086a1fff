"""The ports servers are started on come from outside the range the kernel hands outgoing
connections, so no client's source port can take one between the pick and the bind."""

from __future__ import annotations

import socket
from pathlib import Path

from crescent.services.common.ports import unused_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    taken: set[int] = set()
    ports = [unused_port("127.0.0.1", taken) for _ in range(300)]
    assert len(set(ports)) == 300
    assert max(ports) < _ephemeral_low()
    assert set(ports) == taken


def test_a_port_something_listens_on_is_not_handed_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", unused_port()))
        listener.listen()
        held = listener.getsockname()[1]
        # Everything else is taken, so a pick that ignored the bind would have to return `held`.
        everything_else = set(range(10_000, 65_536)) - {held}
        try:
            port = unused_port("127.0.0.1", everything_else)
        except RuntimeError as exc:
            assert "no free port" in str(exc)
        else:
            raise AssertionError(f"handed out {port}, which is bound")
