"""Fixtures of the fault suite: ``crescent up`` stacks, healthy before every test.

Modules that want the same platform share one stack (starting one costs tens of seconds of
CPU); a module sets ``STACK_PLAN`` (a ``StackPlan``) to want another, and only one stack runs at
a time. So that each plan starts once, the suite's modules run grouped by plan (in file order
within a group, the groups in the order their first module comes). Tests that
break a service leave it to the launcher to bring it back; the next test starts only once every
service answers /health, the gateway sees every engine and a request succeeds, so a service that
never comes back fails the next test's set-up, loudly, naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.faults.load import LoadClient
from tests.faults.scenarios import RECOVERY_TIMEOUT_S
from tests.faults.stack import FaultStack, StackPlan



log = logging.getLogger(__name__)
FAULTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests grouped by their module's ``STACK_PLAN`` (stable: file order within a
    plan), back into the places they had among the session's items."""
    slots = [i for i, item in enumerate(items) if FAULTS in Path(str(item.path)).resolve().parents]
    plans: list[StackPlan] = []  # in the order they first come
    for i in slots:
        plan = _plan(items[i])
        if plan not in plans:
            plans.append(plan)
    grouped = sorted((items[i] for i in slots), key=lambda item: plans.index(_plan(item)))
    for i, item in zip(slots, grouped):
        items[i] = item


def _plan(item: pytest.Item) -> StackPlan:
    return getattr(getattr(item, "module", None), "STACK_PLAN", StackPlan())


class StackPool:
    """At most one stack alive (they are heavy): reused while modules want the same plan,
    replaced when one wants another."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._plan: StackPlan | None = None
        self._stack: FaultStack | None = None

    def get(self, plan: StackPlan) -> FaultStack:
        if self._stack is not None and self._plan == plan and self._stack.proc.poll() is None:
            return self._stack
        self.close()
        self._stack = FaultStack.start(self._tmp.mktemp("stack"), plan)
        self._plan = plan
        return self._stack

    def close(self) -> None:
        if self._stack is not None:
            self._stack.stop()
            self._stack = None


@pytest.fixture(scope="package")  # the last stack stops with this folder's last test, not the session's
def stack_pool(tmp_path_factory: pytest.TempPathFactory):
    pool = StackPool(tmp_path_factory)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, stack_pool: StackPool) -> FaultStack:
    return stack_pool.get(getattr(request.module, "STACK_PLAN", StackPlan()))


@pytest.fixture
def healthy_stack(stack: FaultStack) -> FaultStack:
    seconds = stack.wait_healthy(RECOVERY_TIMEOUT_S)
    log.info("stack healthy after %.1f s", seconds)
    return stack


@pytest.fixture
async def client(healthy_stack: FaultStack):
    async with LoadClient(healthy_stack.url, healthy_stack.model) as load_client:
        yield load_client
