"""The processes that compute nothing start without torch: the `crescent` CLI (`crescent keys`,
`crescent plan`, the launcher of `crescent up`) and the gateway, scheduler and kvstore, each as
its pod starts it (`crescent serve <service>` imports the CLI, then the service's server). Torch
costs such a process over a second of start-up and ~100 MB it never uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts a Python process: `make test-fast` leaves it out (tests/process_guard.py)


@pytest.mark.parametrize("modules", [
    ("crescent.services.cli", "crescent.services.launcher"),
    ("crescent.services.cli", "crescent.services.gateway.server"),
    ("crescent.services.cli", "crescent.services.scheduler.server"),
    ("crescent.services.cli", "crescent.services.kvstore.server"),
], ids=["cli", "gateway", "scheduler", "kvstore"])
def test_a_process_that_computes_nothing_loads_no_torch(modules: tuple[str, ...]) -> None:
    probe = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{' + '.join(modules)} loaded torch"
