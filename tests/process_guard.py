"""Keeps ``-m "not slow"`` (``make test-fast``) an inner loop: a test that starts a process must be
marked ``slow`` (issue 28). A process costs seconds here (a Python interpreter imports torch, a
server waits to be healthy), and process tests missing the mark are how the fast loop grew to
many minutes.

While the mark expression leaves slow tests out, ``subprocess.Popen`` (which ``subprocess.run``
and asyncio's subprocesses go through) refuses to start a process during the setup or call of a
test not marked ``slow``: the test fails at once, naming the command, and nothing is left
running. The static tools the chart tests call in a fraction of a second are allowed.

A pytest plugin: tests/conftest.py registers it; ``-p tests.process_guard`` loads it elsewhere.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

# Quick static checkers and shell snippets (no server, no torch import): what the chart, workflow
# and script tests run in a fraction of a second. And the toolchain torch's cpp_extension calls
# when the engine's C++ decode kernel is first loaded in a process (`ninja --version`, a compile
# once per machine into ~/.cache/crescent/kernels): compute in this process, not a process test.
QUICK_TOOLS = frozenset({"helm", "kubectl", "promtool", "kubernetes-validate", "actionlint", "shellcheck", "node",
                         "git", "sh", "bash", "ninja", "c++", "g++", "gcc", "cc", "which"})

_fast_test: pytest.Item | None = None  # the running test, while it is not marked slow
_popen_init = subprocess.Popen.__init__


def _refusing_init(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
    if _fast_test is not None:
        argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]  # type: ignore[union-attr]
        if argv and Path(argv[0]).name not in QUICK_TOOLS:
            pytest.fail(f"this test starts a process ({' '.join(argv)[:120]}) but is not marked slow: mark it "
                        "@pytest.mark.slow (tests/process_guard.py)", pytrace=False)
    _popen_init(self, args, *rest, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    if "not slow" in (config.option.markexpr or ""):
        subprocess.Popen.__init__ = _refusing_init  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    global _fast_test
    _fast_test = item if item.get_closest_marker("slow") is None else None  # watched: its setup and call
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    global _fast_test
    _fast_test = None  # a teardown may stop what the test started
    return (yield)
