"""The one mover family (``kvwire/movers.py``): order, per-peer refusals, backoff, gRPC last."""

from __future__ import annotations

import pytest

from crescent.services.kvwire import movers
from crescent.services.kvwire.movers import GRPC, Backoff, MoverLadder


class Reports:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def moved(self, peer: str, mover: str, direction: str, nbytes: int) -> None:
        self.events.append(("moved", peer, mover, nbytes))

    def selected(self, peer: str, mover: str, names) -> None:  # noqa: ANN001
        self.events.append(("selected", peer, mover))

    def refused(self, peer: str, mover: str) -> None:
        self.events.append(("refused", peer, mover))


def test_fastest_first_grpc_last_and_a_refusal_is_per_peer() -> None:
    ladder = MoverLadder(["shm", "tcp"])
    assert ladder.open("a") == ["shm", "tcp", GRPC], "gRPC is appended: the ladder never runs out"
    ladder.refuse("a", "shm", "another host")
    assert ladder.open("a") == ["tcp", GRPC]
    assert ladder.open("b") == ["shm", "tcp", GRPC], "another peer is not refused for a's answer"
    with pytest.raises(AssertionError):
        ladder.refuse("a", GRPC, "never")


def test_a_mover_with_a_backoff_is_tried_again_later_and_afresh_after_it_worked(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(movers.time, "monotonic", lambda: now[0])
    reports = Reports()
    ladder = MoverLadder(["shm", "tcp"], backoffs={"tcp": Backoff(5.0, 12.0)}, metrics=reports)
    assert ladder.refuse("a", "tcp", "cut") == 5.0
    assert ladder.open("a") == ["shm", GRPC]
    now[0] += 5.0
    assert "tcp" in ladder.open("a")
    assert ladder.refuse("a", "tcp", "cut again") == 10.0
    assert ladder.refuse("a", "tcp", "and again") == 12.0, "bounded"
    ladder.worked("a", "tcp")
    assert "tcp" in ladder.open("a") and ladder.confirmed("a", "tcp")
    assert ladder.refuse("a", "tcp", "cut") == 5.0, "a move that worked starts the backoff afresh"
    assert ladder.refuse("a", "shm", "cannot map") is None, "no backoff: for good"
    now[0] += 1e6
    assert ladder.open("a") == ["tcp", GRPC]
    assert reports.events.count(("refused", "a", "tcp")) == 4


def test_moves_are_counted_and_a_change_of_mover_reported_once() -> None:
    reports = Reports()
    ladder = MoverLadder(["tcp"], metrics=reports)
    ladder.moved("a", "tcp", "put", 10)
    ladder.moved("a", "tcp", "get", 20)
    ladder.moved("a", GRPC, "put", 30)
    assert reports.events == [("selected", "a", "tcp"), ("moved", "a", "tcp", 10), ("moved", "a", "tcp", 20),
                              ("selected", "a", GRPC), ("moved", "a", GRPC, 30)]
