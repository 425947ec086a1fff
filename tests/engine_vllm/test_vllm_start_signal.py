"""A SIGTERM that reaches a vLLM-backed instance while vLLM is still starting (load, profile,
compile: minutes on a CPU) stops it then, not once the start is over, and leaves none of vLLM's
processes behind. A real instance process; it never gets as far as registering."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from crescent.services.engine_vllm.reaper import descendants
from tests.engine_vllm.vllm_stack import BLOCK, MODEL, assert_reaped, listen, start_service, vllm_interpreter
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

STOPPED_WITHIN_S = 30  # vLLM's start alone takes 100-300 s here


def _vllm_processes(pid: int, timeout_s: float) -> dict[int, int]:
    """Once vLLM's engine core has started its worker (a grandchild of the instance): the
    instance's descendants, pid -> start time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = descendants(pid)
        grandchildren = [p for p in found if any(p in descendants(child) for child in found)]
        if grandchildren:
            return found
        time.sleep(0.5)
    raise AssertionError("vLLM's engine core and worker never started")


def test_sigterm_during_vllms_start_stops_the_instance_at_once(tmp_path: Path) -> None:
    config = {"listen": listen(), "instance_id": "starting-0", "scheduler_address": f"127.0.0.1:{free_port()}",
              "engine": {"backend": "vllm", "model": MODEL, "block_size": BLOCK, "threads": 1,
                         "vllm": {"dtype": "float32", "cpu_kv_cache_gb": 1}}}
    instance = start_service(tmp_path, "starting-0", "aggregated", config, python=vllm_interpreter())
    try:
        processes = _vllm_processes(instance.proc.pid, 600)
        time.sleep(2)  # well inside the worker's model load and compile
        assert "vLLM ready" not in instance.log_tail(100_000)
        sent = time.monotonic()
        instance.proc.send_signal(signal.SIGTERM)
        code = instance.proc.wait(timeout=STOPPED_WITHIN_S)
        took = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        pytest.fail(f"the instance still ran {STOPPED_WITHIN_S} s after SIGTERM:\n{instance.log_tail()}")
    finally:
        if instance.proc.poll() is None:
            instance.proc.kill()
    log = instance.log_tail(100_000)
    assert code == 0, log[-4000:]
    assert "stopped before serving" in log
    assert "vLLM ready" not in log
    assert took < STOPPED_WITHIN_S
    assert_reaped(processes, timeout_s=15)  # engine core and worker gone too, not re-parented to init
