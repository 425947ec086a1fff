"""The contract is the ground floor: importing all of it pulls in neither torch nor gRPC nor a service."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import crescent.services.contract as contract


@pytest.mark.slow  # a fresh interpreter (tests/process_guard.py)
def test_the_contract_imports_neither_torch_nor_grpc_nor_a_service() -> None:
    modules = [f"crescent.services.contract.{m.name}" for m in pkgutil.iter_modules(contract.__path__)]
    assert modules, "the contract has no modules"
    probe = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}];"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc')"
        " or (m.startswith('crescent.services.') and not m.startswith('crescent.services.contract')));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the contract pulled in: {out.stdout.strip()}"
