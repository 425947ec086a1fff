"""The gateway runs without the model compute: it imports ``services.model``, never the engine or torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)


def test_gateway_imports_neither_the_engine_nor_torch() -> None:
    probe = (
        "import sys, crescent.services.gateway.server, crescent.services.gateway.model;"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('crescent.services.engine'));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the gateway pulled in: {out.stdout.strip()}"
