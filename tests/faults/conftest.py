"""Fixtures of the fault suite: ``crescent up`` stacks, healthy before every test.

Modules that run the default platform share one stack for the session (starting one costs tens
of seconds of CPU); a module that sets ``STACK_PLAN`` (a ``StackPlan``) gets its own. Tests that
break a service leave it to the launcher to bring it back; the next test starts only once every
service answers /health, the gateway sees every engine and a request succeeds, so a service that
never comes back fails the next test's set-up, loudly, naming it.
"""

from __future__ import annotations

import logging

import pytest

from tests.faults.load import LoadClient
from tests.faults.stack import FaultStack, StackPlan

RECOVERY_TIMEOUT_S = 90  # a restarted engine loads its model again: seconds on a shared CPU

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory: pytest.TempPathFactory):
    running = FaultStack.start(tmp_path_factory.mktemp("default-stack"), StackPlan())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    plan = getattr(request.module, "STACK_PLAN", None)
    if plan is None or plan == StackPlan():
        yield request.getfixturevalue("default_stack")
        return
    running = FaultStack.start(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), plan)
    yield running
    running.stop()


@pytest.fixture
def healthy_stack(stack: FaultStack) -> FaultStack:
    seconds = stack.wait_healthy(RECOVERY_TIMEOUT_S)
    log.info("stack healthy after %.1f s", seconds)
    return stack


@pytest.fixture
async def client(healthy_stack: FaultStack):
    async with LoadClient(healthy_stack.url, healthy_stack.model) as load_client:
        yield load_client
