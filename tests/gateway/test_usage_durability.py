"""A gateway killed with SIGKILL in the middle of 1,000 concurrent requests loses no completed
request from the usage ledger and counts none twice (docs/usage.md, "Durability").

Every request whose client received a whole response (its usage and its end) is in the ledger
after the restart, once, with status ``ok`` and the usage the client was told. A request cut
off by the kill appears at most once: as ``ok`` when its generation had finished and its row
was committed before the kill (its last bytes were on their way), or not at all.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import os
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .support import FakeBackend, Gateway
from .usage_load import send_all

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

log = logging.getLogger(__name__)

REQUESTS = 1000
KILL_AFTER = 300  # rows committed before the kill


@pytest.fixture(scope="module")
def load_backend() -> Iterator[FakeBackend]:
    """A backend process of its own, not the session's in-process one: under 1,000 concurrent
    requests the clients here and fakes in this process would share one interpreter lock."""
    fake = FakeBackend()
    fake.start_backend()
    yield fake
    fake.stop()


@pytest.fixture(params=["commit-wait", "journal"])
def gateway_to_kill(request: pytest.FixtureRequest, load_backend: FakeBackend,
                    tmp_path: Path) -> Iterator[tuple[Gateway, Path]]:
    """A gateway whose responses wait for their row's commit, or (``ledger.journal_dir``) for its
    write to the local journal that the restarted gateway replays."""
    database = tmp_path / "gateway.sqlite3"
    ledger = {"journal_dir": str(tmp_path / "journal")} if request.param == "journal" else {}
    gw = Gateway(tmp_path, load_backend.address, auth={"database_url": f"sqlite:///{database}"},  # auth off: "default"
                 ledger=ledger)
    gw.start_gateway()
    yield gw, database
    gw.stop()


def committed_rows(database: Path) -> int:
    with sqlite3.connect(database, timeout=5) as db:
        return db.execute("SELECT count(*) FROM usage").fetchone()[0]


def kill_when_committed(gw: Gateway, database: Path, rows: int) -> None:
    """SIGKILL the gateway once ``rows`` rows are committed: its own progress, not the clients' (they
    read slower than it answers). A thread: the clients' busy event loop would starve a task."""
    assert gw.proc is not None
    while gw.proc.poll() is None and committed_rows(database) < rows:
        time.sleep(0.005)
    os.kill(gw.proc.pid, signal.SIGKILL)


def test_kill_9_mid_way_loses_no_completed_request_and_counts_none_twice(gateway_to_kill: Gateway) -> None:
    gw, database = gateway_to_kill

    killer = threading.Thread(target=kill_when_committed, args=(gw, database, KILL_AFTER))
    killer.start()
    # Each token takes 10 ms to decode, so requests overlap and the kill finds many in flight.
    outcomes = asyncio.run(send_all(gw.url, [None], REQUESTS, "fake-model", prefix="#delay=0.01 "))
    killer.join()
    assert gw.proc is not None and gw.proc.wait(timeout=10) == -signal.SIGKILL
    completed = [o for o in outcomes if o.whole]
    cut_off = [o for o in outcomes if not o.whole]
    assert 0 < len(completed) < REQUESTS, "the kill did not land mid-way"

    gw.start_gateway()  # the same database, as a restarted pod would have
    reply = httpx.get(f"{gw.url}/v1/usage", params={"format": "csv"}, timeout=30)
    rows = list(csv.DictReader(io.StringIO(reply.text)))
    ids = Counter(r["request_id"] for r in rows)
    assert [i for i, n in ids.items() if n > 1] == [], "a request was counted twice"
    by_id = {r["request_id"]: r for r in rows}

    for o in completed:
        found = [by_id.get(i) for i in o.ledger_ids()]
        assert None not in found, f"a completed {o.kind} request is missing from the ledger: {o.id}"
        assert {r["status"] for r in found} == {"ok"}
        tokens = tuple(sum(int(r[c]) for r in found) for c in ("prompt_tokens", "cached_tokens", "completion_tokens"))
        assert tokens == (o.prompt, o.cached, o.completion)
    # Rows of cut-off requests: at most one each (by the primary key), and no row from nowhere.
    possible = sum(len(o.ledger_ids()) if o.id else (2 if o.kind == "completions_2_prompts" else 1) for o in outcomes)
    assert len(rows) <= possible
    of_completed = {i for o in completed for i in o.ledger_ids()}
    others = [r for r in rows if r["request_id"] not in of_completed]
    log.info("kill -9 after %d committed rows: %d responses received whole (all in the ledger), %d cut off; "
             "%d rows in all, %d of them of cut-off requests (%s)", KILL_AFTER, len(completed), len(cut_off),
             len(rows), len(others), dict(Counter(r["status"] for r in others)))

    # The restarted gateway goes on writing to the same ledger.
    after = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                       json={"model": "fake-model", "messages": [{"role": "user", "content": "after"}], "max_tokens": 2})
    assert after.status_code == 200
    totals = httpx.get(f"{gw.url}/v1/usage", timeout=30).json()["total"]
    assert totals["requests"] == len(rows) + 1
