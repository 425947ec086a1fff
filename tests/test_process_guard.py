"""``make test-fast`` (``-m "not slow"``) stays fast because a test that starts a process and is
not marked slow fails there at once (tests/process_guard.py); the full suite runs it as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # it runs pytest as a process

REPO = Path(__file__).resolve().parents[1]
TESTS = '''
import subprocess, sys
import pytest

def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.slow
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_runs_a_quick_tool_or_nothing():
    subprocess.run(["git", "--version"], check=True, capture_output=True)
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.process_guard", "-p", "no:cacheprovider",
                           "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_sample.py"), *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_an_unmarked_process_test_fails_the_fast_run_naming_the_fix(tmp_path: Path) -> None:
    fast = _pytest(tmp_path, "-m", "not slow", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    assert fast.returncode == 1, fast.stdout
    assert "1 failed, 1 passed, 1 deselected" in fast.stdout
    assert "test_unmarked_starts_a_process" in fast.stdout and "is not marked slow" in fast.stdout


def test_the_full_run_is_unchanged(tmp_path: Path) -> None:
    full = _pytest(tmp_path, "-W", "ignore::pytest.PytestUnknownMarkWarning")
    assert full.returncode == 0, full.stdout
    assert "3 passed" in full.stdout
