"""The scheduler sits below every data-plane role, and its modules import one another without a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "services" / "scheduler"
ROLES = ("prefill", "decode", "aggregated", "engine", "engine_vllm", "kvstore", "instance", "gateway")


@pytest.mark.slow  # a fresh interpreter (tests/process_guard.py)
def test_the_scheduler_imports_no_data_plane_role() -> None:
    probe = (
        "import sys, crescent.services.scheduler.server, crescent.services.scheduler.picker_server;"
        f"bad = sorted(m for m in sys.modules if m.split('.')[2:3] and m.split('.')[2] in {ROLES!r} "
        "and m.startswith('crescent.services.'));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the scheduler pulled in: {out.stdout.strip()}"


def _scheduler_imports(path: Path) -> set[str]:
    """Scheduler modules ``path`` imports anywhere in the file (a TYPE_CHECKING block counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.rsplit(".", 1)[-1] for n in names if n.startswith("crescent.services.scheduler.")}
    return found


def test_scheduler_modules_form_no_import_cycle() -> None:
    graph = {p.stem: _scheduler_imports(p) for p in SCHEDULER.glob("*.py")}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path, module))
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
    assert "TYPE_CHECKING" not in (SCHEDULER / "discovery.py").read_text()
