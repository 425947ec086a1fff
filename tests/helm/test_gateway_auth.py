"""The chart turns API keys on by default and takes the gateway's auth secrets from a Secret."""

from __future__ import annotations

from typing import Any

import yaml

from crescent.services.gateway.config import GatewaySettings
from tests.helm.crd_schemas import schema_errors
from tests.helm.tools import by_kind, helm_template, render

GATEWAY = "crescent-gateway"


def gateway_settings(docs: list[dict[str, Any]]) -> GatewaySettings:
    config = yaml.safe_load(by_kind(docs, "ConfigMap")[GATEWAY]["data"]["config.yaml"])
    return GatewaySettings.model_validate(config)


def gateway_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = by_kind(docs, "Deployment")[GATEWAY]["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_auth_is_on_by_default() -> None:
    docs = render()
    assert gateway_settings(docs).auth.enabled
    assert not any(name.startswith("CRESCENT_GATEWAY__AUTH__") for name in gateway_env(docs))


def test_auth_can_be_turned_off_only_in_so_many_words() -> None:
    refused = helm_template("--set", "gateway.auth.enabled=false")
    assert refused.returncode != 0 and "gateway.auth.allowUnauthenticatedNetwork=true" in refused.stderr
    settings = gateway_settings(render("--set", "gateway.auth.enabled=false",
                                       "--set", "gateway.auth.allowUnauthenticatedNetwork=true"))
    assert not settings.auth.enabled and settings.auth.allow_unauthenticated_network


def test_secrets_come_from_the_named_secret_never_inline() -> None:
    docs = render("--set", "gateway.auth.existingSecret=gateway-auth")
    env = gateway_env(docs)
    for setting, key in (("ADMIN_KEY", "admin-key"), ("CACHE_SALT_SECRET", "cache-salt-secret")):
        ref = env[f"CRESCENT_GATEWAY__AUTH__{setting}"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "gateway-auth", "key": key, "optional": True}
    # The database is SQLite on a claim by default; a PostgreSQL URL comes from a Secret too
    # (test_gateway_state).
    assert "CRESCENT_GATEWAY__AUTH__DATABASE_URL" not in env
    config = by_kind(docs, "ConfigMap")[GATEWAY]["data"]["config.yaml"]
    assert "admin_key" not in config and "cache_salt_secret" not in config


def test_a_misspelt_auth_key_is_refused() -> None:
    result = helm_template("--set", "gateway.auth.enable=true")
    assert result.returncode != 0 and "enable" in result.stderr


def test_prometheus_scrapes_tenant_spend_with_the_admin_key() -> None:
    """With auth on the gateway serves per-tenant spend to the admin key alone: its ServiceMonitor
    sends that key (from the auth Secret) and the object passes the ServiceMonitor schema."""
    docs = render("--set", "monitoring.serviceMonitor.enabled=true", "--set", "gateway.auth.existingSecret=gw-auth")
    monitor = by_kind(docs, "ServiceMonitor")[GATEWAY]
    assert monitor["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "gw-auth", "key": "admin-key"}}
    assert not any(schema_errors([monitor]).values())
    without = by_kind(render("--set", "monitoring.serviceMonitor.enabled=true"), "ServiceMonitor")[GATEWAY]
    assert "authorization" not in without["spec"]["endpoints"][0], "no admin key: the open metrics only"
