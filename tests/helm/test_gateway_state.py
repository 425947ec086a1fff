"""The gateway's state in the chart: its database (keys and the usage ledger), its limits store,
default limits, the price table and the ledger's journal.

One replica may keep its state in the pod (SQLite on a claim, counters in memory); several must
share PostgreSQL and Redis, whose URLs come from Secrets, and the chart refuses to render
anything else. Rendered settings are loaded in ``GatewaySettings`` with the environment the pod
would get (Secret values filled in), so a wrong variable name or setting fails here.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from crescent.services.common.settings import load_settings
from crescent.services.gateway.config import ENV_PREFIX, GatewaySettings
from crescent.services.tenancy.pricing import ModelPrices
from tests.helm.tools import by_kind, helm_template, render

GATEWAY = "crescent-gateway"
SHARED = ["--set", "gateway.replicas=3", "--set", "gateway.database.type=postgresql",
          "--set", "gateway.limits.store=redis", "--set", "gateway.auth.existingSecret=gateway-secrets"]
SECRETS = {"gateway-secrets": {"database-url": "postgresql://crescent:pw@postgres:5432/crescent",
                               "redis-url": "redis://redis:6379/0", "admin-key": "admin-123"},
           "pg": {"url": "postgresql://other@pg:5432/db"}, "rd": {"url": "rediss://rd:6380/1"}}


def gateway_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway Deployment's pod spec and its one container."""
    spec = by_kind(docs, "Deployment")[GATEWAY]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """What the container's env would be, with the Secrets in SECRETS (a missing required key fails)."""
    env: dict[str, str] = {}
    for var in container["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            env[var["name"]] = var.get("value", "")
        elif ref["key"] in SECRETS.get(ref["name"], {}):
            env[var["name"]] = SECRETS[ref["name"]][ref["key"]]
        else:
            assert ref.get("optional"), f"{var['name']}: Secret {ref['name']} has no key {ref['key']}"
    return env


def settings(docs: list[dict[str, Any]], tmp_path: Path) -> GatewaySettings:
    """The gateway's settings as its pod would load them: the ConfigMap plus the pod's env."""
    path = tmp_path / "config.yaml"
    path.write_text(by_kind(docs, "ConfigMap")[GATEWAY]["data"]["config.yaml"])
    _, container = gateway_pod(docs)
    return load_settings(GatewaySettings, path, env_prefix=ENV_PREFIX, environ=pod_env(container))


def mounts(docs: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Volume name -> (mount path, volume source) of the gateway container."""
    spec, container = gateway_pod(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["name"]: (m["mountPath"], volumes[m["name"]]) for m in container["volumeMounts"]}


def refusal(*args: str) -> str:
    result = helm_template(*args)
    assert result.returncode != 0, "the chart rendered values it should refuse"
    return result.stderr


def test_one_replica_keeps_sqlite_on_a_kept_claim(tmp_path: Path) -> None:
    docs = render()
    loaded = settings(docs, tmp_path)
    assert by_kind(docs, "Deployment")[GATEWAY]["spec"]["replicas"] == 1
    path, volume = mounts(docs)["database"]
    assert loaded.auth.database_url == f"sqlite:///{path}/gateway.sqlite3"  # an absolute path in the claim
    claim = by_kind(docs, "PersistentVolumeClaim")[volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # keys outlive the release
    # Never two pods on the one SQLite file, even during a rollout.
    assert by_kind(docs, "Deployment")[GATEWAY]["spec"]["strategy"] == {"type": "Recreate"}
    assert loaded.limits.store == "memory"
    assert GATEWAY not in by_kind(docs, "PodDisruptionBudget")  # it would block every node drain


def test_an_existing_claim_is_used_as_is() -> None:
    docs = render("--set", "gateway.database.sqlite.existingClaim=my-claim")
    assert mounts(docs)["database"][1]["persistentVolumeClaim"] == {"claimName": "my-claim"}
    assert by_kind(docs, "PersistentVolumeClaim") == {}


@pytest.mark.parametrize(("args", "named"), [
    (["--set", "gateway.replicas=2"], ["gateway.replicas is 2", "gateway.limits.store", "redis"]),
    (["--set", "gateway.replicas=2", "--set", "gateway.limits.store=redis", "--set",
      "gateway.limits.redis.existingSecret=rd"], ["gateway.replicas is 2", "gateway.database.type", "postgresql"]),
    (["--set", "gateway.database.type=postgresql"], ["gateway.database.postgresql.existingSecret", "database-url"]),
    (["--set", "gateway.limits.store=redis"], ["gateway.limits.redis.existingSecret", "redis-url"]),
    (["--set", "gateway.settings.limits.store=redis://redis:6379/0"], ["gateway.limits.store"]),
    (["--set", "gateway.settings.auth.database_url=postgresql://u:pw@h/db"], ["gateway.database"]),
    (["--set", "gateway.settings.auth.admin_key=inline"], ["admin-key", "gateway.auth.existingSecret"]),
])
def test_state_that_would_split_or_leak_is_refused_with_a_clear_message(args: list[str], named: list[str]) -> None:
    message = refusal(*args)
    for words in named:
        assert words in message, message


def test_several_replicas_share_postgresql_and_redis_from_secrets(tmp_path: Path) -> None:
    docs = render(*SHARED)
    loaded = settings(docs, tmp_path)
    assert loaded.auth.database_url == SECRETS["gateway-secrets"]["database-url"]
    assert loaded.limits.store == SECRETS["gateway-secrets"]["redis-url"]
    assert loaded.auth.admin_key is not None and loaded.auth.admin_key.get_secret_value() == "admin-123"
    config = by_kind(docs, "ConfigMap")[GATEWAY]["data"]["config.yaml"]
    assert "database_url" not in config and "store:" not in config and "postgresql" not in config
    _, container = gateway_pod(docs)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    assert not refs["CRESCENT_GATEWAY__AUTH__DATABASE_URL"].get("optional")  # a missing URL stops the pod
    assert not refs["CRESCENT_GATEWAY__LIMITS__STORE"].get("optional")
    assert "database" not in mounts(docs) and by_kind(docs, "PersistentVolumeClaim") == {}
    assert "strategy" not in by_kind(docs, "Deployment")[GATEWAY]["spec"]  # rolling updates
    assert by_kind(docs, "PodDisruptionBudget")[GATEWAY]["spec"]["minAvailable"] == 1


def test_each_url_may_come_from_its_own_secret(tmp_path: Path) -> None:
    loaded = settings(render(*SHARED, "--set", "gateway.database.postgresql.existingSecret=pg",
                             "--set", "gateway.database.postgresql.urlKey=url",
                             "--set", "gateway.limits.redis.existingSecret=rd",
                             "--set", "gateway.limits.redis.urlKey=url"), tmp_path)
    assert (loaded.auth.database_url, loaded.limits.store) == (SECRETS["pg"]["url"], SECRETS["rd"]["url"])


def test_limits_prices_and_ledger_reach_the_gateway(tmp_path: Path) -> None:
    # From a values file, as operators write them: Helm reads its numbers as floats, and a large
    # integer must not reach the gateway as 1e+06.
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"gateway": {
        "limits": {"key": {"rpm": 600, "tpm": 1000000, "maxConcurrent": 8},
                   "tenant": {"tpm": 20000000, "budgetUsd": "1234.56"},
                   "tokenWeights": {"prompt": 1.0, "cached": 0.25, "completion": 2},
                   "onStoreError": "closed", "storeTimeoutSeconds": 0.5, "leaseSeconds": 45},
        "prices": {"kimi-k3": {"cacheHitInput": "0.15", "cacheMissInput": 1.5, "output": "7.50"}},
        "ledger": {"durable": False, "commitWaitSeconds": 2.5, "batchRows": 100},
    }}))
    loaded = settings(render(values=[values]), tmp_path)
    limits = loaded.limits
    assert (limits.key.rpm, limits.key.tpm, limits.key.max_concurrent, limits.key.budget_usd) == (600, 1000000, 8, None)
    assert (limits.tenant.rpm, limits.tenant.tpm, limits.tenant.budget_usd) == (None, 20000000, Decimal("1234.56"))
    assert (limits.token_weights.prompt, limits.token_weights.cached, limits.token_weights.completion) == (1, 0.25, 2)
    assert (limits.on_store_error, limits.store_timeout_s, limits.lease_s) == ("closed", 0.5, 45)
    assert loaded.prices.for_model("kimi-k3") == ModelPrices(cache_hit_input=Decimal("0.15"),
                                                             cache_miss_input=Decimal("1.5"), output=Decimal("7.50"))
    assert loaded.prices.for_model("any-other-model") == ModelPrices()  # "*" stays: K3's published prices
    assert (loaded.ledger.enabled, loaded.ledger.durable, loaded.ledger.commit_wait_s, loaded.ledger.batch_rows) == (
        True, False, 2.5, 100)


def test_defaults_are_the_gateways_own(tmp_path: Path) -> None:
    loaded = settings(render(), tmp_path)
    defaults = GatewaySettings()
    assert loaded.limits.model_dump(exclude={"store"}) == defaults.limits.model_dump(exclude={"store"})
    assert loaded.prices == defaults.prices
    assert loaded.ledger.model_dump(exclude={"journal_dir"}) == defaults.ledger.model_dump(exclude={"journal_dir"})


def test_the_ledger_journal_lives_in_an_empty_dir(tmp_path: Path) -> None:
    docs = render()
    path, volume = mounts(docs)["ledger-journal"]
    assert path == "/var/lib/crescent/ledger-journal" and volume["emptyDir"] == {}
    assert settings(docs, tmp_path).ledger.journal_dir == path
    moved = render("--set", "gateway.ledger.journalDir=/journal")
    assert mounts(moved)["ledger-journal"][0] == "/journal"
    off = render("--set", "gateway.ledger.journalDir=")
    assert "ledger-journal" not in mounts(off)
    assert settings(off, tmp_path).ledger.journal_dir is None


@pytest.mark.parametrize("args", [
    ["--set", "gateway.limits.key.rmp=60"],                               # misspelt limit
    ["--set", "gateway.limits.tenant.rpm=0"],                             # no limit is "absent", not 0
    ["--set", "gateway.limits.store=redis://redis:6379/0"],               # a URL belongs in a Secret
    ["--set", "gateway.database.type=mysql"],
    ["--set", "gateway.limits.tokenWeights.cached=-1"],
    ["--set", "gateway.ledger.journalDir=relative/dir"],
    ["--set-json", 'gateway.prices={"m": {"output": "1.00"}}'],           # every price named
    ["--set-json", 'gateway.prices={"m": {"cacheHitInput": "0.1", "cacheMissInput": "1", "output": "$2"}}'],
])
def test_the_schema_refuses_bad_values(args: list[str]) -> None:
    result = helm_template(*args)
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr
