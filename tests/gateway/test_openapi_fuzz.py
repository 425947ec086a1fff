"""A bounded schemathesis run over the gateway's own OpenAPI document: no input gives a 5xx.

Schemathesis generates requests from the schema, ones that follow it (positive) and ones that
break it (negative), and sends them to the real gateway process in front of the fake backend.
Every answer must be a non-5xx with a status and content type the document declares.
(Driven through hypothesis directly: schemathesis' pytest plugin does not run under pytest 9.)
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (hypothesis comes with schemathesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance  # noqa: E402

from .support import Gateway  # noqa: E402

pytestmark = pytest.mark.slow  # minutes of generated requests (on the in-process gateway): not an inner-loop test

EXAMPLES = 50  # per operation and mode: bounded, a few seconds each
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


def operations(gateway: Gateway) -> list[object]:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_generated_request_gets_a_5xx(gateway: Gateway, mode: GenerationMode) -> None:
    ops = operations(gateway)
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}
    sent: dict[str, int] = {}
    for op in ops:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            response = case.call(base_url=gateway.url, timeout=10)
            sent[op.path] = sent.get(op.path, 0) + 1
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # an operation without inputs has nothing to break
    assert sent.get("/v1/chat/completions", 0) >= EXAMPLES // 2, sent
