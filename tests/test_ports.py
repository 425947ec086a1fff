"""The ports servers are started on come from outside the range the kernel hands outgoing
connections, so no client's source port can take one between the pick and the bind."""

from __future__ import annotations

import socket
from pathlib import Path

from crescent.services.common.ports import unused_port, worker_port_range


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


def test_a_port_range_from_the_environment_bounds_the_picks(monkeypatch):
    monkeypatch.setenv("CRESCENT_PORT_RANGE", "20000-20049")
    taken: set[int] = set()
    ports = [unused_port("127.0.0.1", taken) for _ in range(40)]
    assert all(20000 <= port <= 20049 for port in ports) and len(set(ports)) == 40


def test_a_malformed_port_range_is_refused_by_name(monkeypatch):
    for bad in ("20000", "20049-20000", "abc-def", "80-90"):
        monkeypatch.setenv("CRESCENT_PORT_RANGE", bad)
        try:
            unused_port()
        except ValueError as exc:
            assert "CRESCENT_PORT_RANGE" in str(exc) and bad in str(exc)
        else:
            raise AssertionError(f"{bad!r} was taken")


def test_workers_get_slices_that_do_not_overlap():
    slices = [worker_port_range(i, 3) for i in range(3)]
    bounds = [tuple(int(p) for p in s.split("-")) for s in slices]
    for (low, high), (next_low, _) in zip(bounds, bounds[1:]):
        assert low <= high < next_low
    assert bounds[-1][1] < _ephemeral_low()
