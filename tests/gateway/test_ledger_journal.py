"""The usage ledger's write-ahead journal on its own: rows survive their writer, are replayed by
the next gateway (not by a live one sharing the directory), and segments go once committed."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from crescent.services.gateway import ledger_journal
from crescent.services.gateway.ledger_journal import Journal
from crescent.services.tenancy.usage import UsageRow


def row(i: int) -> UsageRow:
    return UsageRow(request_id=f"req-{i}", created_at=datetime(2026, 12, 2, 10, 0, i % 60, tzinfo=UTC),
                    tenant_id="default", api_key_id=None, model="m", status="ok", prompt_tokens=10 + i,
                    cached_tokens=i, completion_tokens=3, reasoning_tokens=1, ttft_s=0.25, cost_nusd=7 * i,
                    savings_nusd=i)


@pytest.mark.slow
def test_rows_of_a_killed_writer_are_recovered_whole_and_a_live_ones_are_not(tmp_path: Path) -> None:
    live = Journal(tmp_path)
    live.append(row(1000))  # a gateway still running beside: its rows are its own
    # A writer that journals 50 rows and dies (os._exit: no clean-up, like kill -9).
    script = (f"import os\nfrom crescent.services.gateway.ledger_journal import Journal\n"
              f"from tests.gateway.test_ledger_journal import row\n"
              f"j = Journal({str(tmp_path)!r})\nfor i in range(50): j.append(row(i))\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[2])
    with open(tmp_path / "usage-1-1.jsonl", "wb") as f:  # an older journal cut in the middle of a line
        f.write(ledger_journal.encode(row(77)) + ledger_journal.encode(row(78))[:20])

    recoverer = Journal(tmp_path)
    recovered = recoverer.recover()
    assert sorted(r.request_id for r, _ in recovered) == sorted([f"req-{i}" for i in range(50)] + ["req-77"])
    assert {r.request_id: r for r, _ in recovered}["req-7"] == row(7), "every field comes back as written"
    for _, segment in recovered:  # committed
        recoverer.done(segment)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.current_path.name, recoverer.current_path.name])
    assert Journal(tmp_path).recover() == [], "nothing is replayed twice"


def test_segments_are_emptied_or_deleted_once_committed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ledger_journal, "SEGMENT_BYTES", 2000)
    journal = Journal(tmp_path)
    segments = [journal.append(row(i)) for i in range(30)]
    assert len({s.path for s in segments}) > 2, "the journal moved on to new segments as it grew"
    for segment in segments:
        journal.done(segment)
    files = list(tmp_path.iterdir())
    assert files == [journal.current_path] and files[0].stat().st_size == 0, "only the current one is left, empty"
    journal.append(row(99))
    assert files[0].read_bytes() == ledger_journal.encode(row(99)), "the next row starts the emptied file"
    journal.close()
    assert os.listdir(tmp_path) == [f.name for f in files], "a row still pending keeps its segment"
