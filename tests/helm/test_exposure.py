"""Nothing private on a public path: the Ingress and the HTTPRoute route gateway.routedPaths (the
API and /health), never /metrics (per-tenant spend) or /admin.

The probe is the real gateway application (built in-process, as the gateway process builds it)
with a tenant's spend recorded: every path it serves that the rendered routes reach is fetched
with the admin key (the most any caller could hold) and must carry no tenant-labelled series,
while /metrics, unrouted, does carry them for that key (so the probe would see a leak).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from crescent.services.common.metrics import usage_metrics
from crescent.services.gateway.app import build_app
from crescent.services.gateway.auth import Authenticator
from crescent.services.gateway.config import GatewaySettings
from crescent.services.gateway.drain import Drain
from tests.gateway.fake_tokenizer import fake_served_model
from tests.helm.crd_schemas import schema_errors
from tests.helm.tools import EXAMPLES, by_kind, helm_template, render

ADMIN_KEY = "crs-admin-exposure-test"
PARENT = '[{"name":"public","namespace":"gateways","sectionName":"https"}]'
BOTH_ROUTES = ["--set", "gateway.ingress.enabled=true", "--set", "gateway.httpRoute.enabled=true",
               "--set-json", f"gateway.httpRoute.parentRefs={PARENT}"]


def _matchers(docs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(object, match type, path) of every path the rendered Ingresses and HTTPRoutes route."""
    found = []
    for name, ingress in by_kind(docs, "Ingress").items():
        for rule in ingress["spec"]["rules"]:
            found += [(f"Ingress/{name}", p["pathType"], p["path"]) for p in rule["http"]["paths"]]
        assert "defaultBackend" not in ingress["spec"]
    for name, route in by_kind(docs, "HTTPRoute").items():
        for rule in route["spec"]["rules"]:
            for match in rule.get("matches") or [{"path": {"type": "PathPrefix", "value": "/"}}]:  # none: every path
                path = match.get("path", {"type": "PathPrefix", "value": "/"})
                found.append((f"HTTPRoute/{name}", path.get("type", "PathPrefix"), path.get("value", "/")))
    return found


def _routes(kind: str, value: str, path: str) -> bool:
    """Kubernetes' Ingress Prefix and Gateway API PathPrefix both match whole path elements:
    /v1 takes /v1 and /v1/models, not /v1x; Exact takes the path alone."""
    if kind == "Exact":
        return path == value
    assert kind in ("Prefix", "PathPrefix"), f"{kind}: an implementation-specific match cannot be checked"
    prefix = value.rstrip("/")
    return prefix == "" or path == prefix or path.startswith(prefix + "/")


def _routed(docs: list[dict[str, Any]], path: str) -> list[str]:
    return [obj for obj, kind, value in _matchers(docs) if _routes(kind, value, path)]


@pytest.fixture(scope="module")
def gateway_app(tmp_path_factory: pytest.TempPathFactory) -> tuple[TestClient, str]:
    """The gateway's application with auth on, an admin key, a tenant key, and spend recorded
    for that tenant; and the tenant's key."""
    directory = tmp_path_factory.mktemp("exposure")
    settings = GatewaySettings.model_validate({
        "scheduler_address": "127.0.0.1:1", "responses_db": ":memory:",
        "auth": {"enabled": True, "database_url": f"sqlite:///{directory}/gateway.sqlite3",
                 "admin_key": ADMIN_KEY, "cache_salt_secret": "exposure-test"}})
    auth = Authenticator.open(settings.auth)
    tenant_key = auth.store.create_key("acme", create_tenant=True).key
    usage_metrics().spend_usd.labels(tenant="acme", model="fake-model").inc(1.25)
    app = build_app(settings, object(), fake_served_model(settings), Drain(), auth)  # type: ignore[arg-type]
    return TestClient(app, base_url="http://localhost"), tenant_key


def _served_paths(client: TestClient) -> set[str]:
    """Paths the application serves: its documented operations (parameters filled in) and the
    admin API, which it leaves out of its document."""
    documented = client.get("/openapi.json").json()["paths"]
    paths = {path.replace("{response_id}", "resp_x").replace("{model_id}", "fake-model") for path in documented}
    return paths | {"/metrics", "/admin/tenants", "/admin/keys", "/admin/usage", "/admin/limits"}


def test_default_routes_are_the_api_and_health() -> None:
    docs = render(*BOTH_ROUTES)
    assert {(obj.split("/")[0], kind, value) for obj, kind, value in _matchers(docs)} == {
        ("Ingress", "Prefix", "/v1"), ("Ingress", "Prefix", "/health"),
        ("HTTPRoute", "PathPrefix", "/v1"), ("HTTPRoute", "PathPrefix", "/health")}
    for private in ("/metrics", "/metrics/", "/admin", "/admin/tenants", "/admin/usage"):
        assert _routed(docs, private) == [], private


def test_no_tenant_series_is_reachable_through_a_routed_path(gateway_app: tuple[TestClient, str]) -> None:
    client, tenant_key = gateway_app
    docs = render(*BOTH_ROUTES)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    # Unrouted, /metrics does carry the tenant's spend for the admin key: the probe can see a leak.
    assert 'tenant="acme"' in client.get("/metrics", headers=admin).text
    reached = {path for path in _served_paths(client) if _routed(docs, path)}
    assert {"/v1/chat/completions", "/v1/models", "/v1/usage", "/health"} <= reached
    assert not {p for p in reached if p == "/metrics" or p.startswith("/admin")}, reached
    for path in sorted(reached):
        for headers in (admin, {"Authorization": f"Bearer {tenant_key}"}):
            body = client.get(path, headers=headers).text
            assert "tenant=" not in body, (path, body[:200])


@pytest.mark.parametrize("paths", [["/"], ["/v1", "/metrics"], ["/admin/"], ["/metrics/tenants"]])
def test_a_routed_path_that_reaches_metrics_or_admin_is_refused(paths: list[str]) -> None:
    result = helm_template("--set-json", f"gateway.routedPaths={json.dumps(paths)}")
    assert result.returncode != 0 and "gateway.routedPaths" in result.stderr


def test_routed_paths_are_one_list_for_both_routes() -> None:
    docs = render(*BOTH_ROUTES, "--set-json", 'gateway.routedPaths=["/v1"]')
    assert {value for _, _, value in _matchers(docs)} == {"/v1"}
    assert _routed(docs, "/health") == []


def test_httproute_attaches_to_its_parents_and_matches_the_gateway_api_schema() -> None:
    docs = render(*BOTH_ROUTES, "--set-json", 'gateway.httpRoute.hostnames=["llm.example.com"]',
                  "--set-json", 'gateway.httpRoute.timeouts={"request":"600s"}')
    route = by_kind(docs, "HTTPRoute")["crescent-gateway"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    service = by_kind(docs, "Service")["crescent-gateway"]
    assert rule["backendRefs"] == [{"name": "crescent-gateway", "port": service["spec"]["ports"][0]["port"]}]
    assert rule["timeouts"] == {"request": "600s"}
    assert schema_errors([route]) == {"HTTPRoute/crescent-gateway": None}


def test_httproute_without_a_parent_is_refused() -> None:
    result = helm_template("--set", "gateway.httpRoute.enabled=true")
    assert result.returncode != 0 and "gateway.httpRoute.parentRefs" in result.stderr


def test_no_example_serves_plain_http_on_port_443() -> None:
    """The gateway speaks plain HTTP; an example must not put it on a load balancer's HTTPS port."""
    for example in sorted(EXAMPLES.glob("*.yaml")):
        if example.name == "node-shapes.yaml":
            continue
        service = by_kind(render(values=[example]), "Service").get("crescent-gateway")
        if service is not None:
            assert all(port["port"] != 443 for port in service["spec"]["ports"]), example.name
