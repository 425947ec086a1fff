"""The YAML settings the chart renders load in the services' own settings models.

Each service validates its settings strictly (unknown keys are errors), so this keeps the chart
in step with services/*/config.py: a renamed setting fails here, not in a crash-looping pod.
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from crescent.services.contract.roles import ENGINE_ROLES, SERVICE_SETTINGS
from tests.helm.test_chart import VALUES_FILES
from tests.helm.tools import CHART, by_kind, helm_template, render

SETTINGS = SERVICE_SETTINGS
ENGINES = ENGINE_ROLES
# What the downward API would give the pod.
POD_FIELDS = {"POD_NAME": "crescent-prefill-g0-abcde", "POD_IP": "10.1.2.3", "NODE_NAME": "gpu-node-0"}
FIELD_PATHS = {"metadata.name": "POD_NAME", "status.podIP": "POD_IP", "spec.nodeName": "NODE_NAME"}


def _pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes would set it (fieldRefs and $(VAR) resolved)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), POD_FIELDS.get(m.group(1), "")), var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = POD_FIELDS[FIELD_PATHS[var["valueFrom"]["fieldRef"]["fieldPath"]]]
    return env


def _enabled(values_files: list[Path], service: str) -> bool:
    """Whether the service is on, by the chart's defaults and the example's values."""
    enabled = yaml.safe_load((CHART / "values.yaml").read_text())[service].get("enabled", True)
    for path in values_files:
        enabled = (yaml.safe_load(path.read_text()).get(service) or {}).get("enabled", enabled)
    return enabled


CASES = [(name, service) for name in sorted(VALUES_FILES) for service in sorted(SETTINGS)
         if _enabled(VALUES_FILES[name], service)]


@functools.cache
def _rendered(name: str) -> list[dict[str, Any]]:
    """Each example rendered once for every service's case (renders are slow)."""
    return render(values=VALUES_FILES[name])


@pytest.mark.parametrize(("name", "service"), CASES)
def test_rendered_settings_load_in_the_service(tmp_path: Path, name: str, service: str) -> None:
    module_name, class_name = SETTINGS[service]
    module = pytest.importorskip(module_name, reason=f"{module_name} is not written yet")
    settings_module = importlib.import_module("crescent.services.common.settings")
    docs = _rendered(name)
    config = by_kind(docs, "ConfigMap")[f"crescent-{service}"]["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(config)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")
                 and d["metadata"]["labels"]["app.kubernetes.io/component"] == service]
    assert workloads
    container = workloads[0]["spec"]["template"]["spec"]["containers"][0]
    # The container starts the service named in its args, with the mounted config.
    assert container["args"] == [service, "--config", "/etc/crescent/config.yaml"]
    settings = settings_module.load_settings(
        getattr(module, class_name), path, env_prefix=module.ENV_PREFIX, environ=_pod_env(container)
    )
    assert settings.listen.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if service == "gateway":
        assert settings.listen.port == ports["http"]
    else:
        assert (settings.listen.port, settings.listen.admin_port) == (ports["grpc"], ports["admin"])
    if service in ENGINES:
        assert settings.instance_id == f"{service}-{POD_FIELDS['POD_NAME']}-{ports['grpc']}"  # as discovery names it
        assert settings.advertise_address == f"{POD_FIELDS['POD_IP']}:{ports['grpc']}"
    if service == "kvstore":
        assert settings.node_id == POD_FIELDS["NODE_NAME"]
    if service == "scheduler":
        assert settings.discovery.enabled  # every example leaves scheduler.kubernetesDiscovery on
    if service == "gateway":
        assert settings.drain_grace_s > 0  # from terminationGracePeriodSeconds, see test_lifecycle
    if service in ENGINES:
        assert settings.engine.drain_grace_s > 0
    if service != "scheduler" and hasattr(settings, "scheduler_address"):
        assert settings.scheduler_address == "crescent-scheduler:50051"


# ---- the values schema knows each service's settings (helm/schema/settings_schema.py) -------------


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_a_misspelt_setting_fails_helm_install_naming_it(service: str) -> None:
    """Not a pod that crash-loops on its strict settings after the release is installed."""
    result = helm_template("--set", f"{service}.settings.heartbeat_intervl_s=2")
    assert result.returncode != 0
    assert f"at '/{service}/settings': additional properties 'heartbeat_intervl_s' not allowed" in result.stderr


def test_nested_settings_are_checked_by_name_and_value() -> None:
    typo = helm_template("--set", "prefill.settings.engine.theads=2")
    assert typo.returncode != 0 and "at '/prefill/settings/engine': additional properties 'theads'" in typo.stderr
    wrong = helm_template("--set", "decode.settings.engine.kv_cache_dtype=int3")
    assert wrong.returncode != 0 and "at '/decode/settings/engine/kv_cache_dtype': value must be one of" in wrong.stderr


def test_settings_given_as_helm_set_writes_them_render_and_load(tmp_path: Path) -> None:
    """Partial overrides, numbers as strings (--set-string, quoted YAML): the schema takes what
    the service's settings model takes."""
    module_name, class_name = SETTINGS["aggregated"]
    module = importlib.import_module(module_name)
    docs = render("--set", "aggregated.enabled=true", "--set-string", "aggregated.settings.chunk_tokens=128",
                  "--set-string", "aggregated.settings.engine.threads=1",
                  "--set", "scheduler.settings.heartbeat_interval_s=0.5")
    path = tmp_path / "config.yaml"
    path.write_text(by_kind(docs, "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"])
    load_settings = importlib.import_module("crescent.services.common.settings").load_settings
    settings = load_settings(getattr(module, class_name), path, env_prefix=module.ENV_PREFIX, environ=POD_FIELDS)
    assert (settings.chunk_tokens, settings.engine.threads) == (128, 1)
    module_name, class_name = SETTINGS["scheduler"]
    module = importlib.import_module(module_name)
    path.write_text(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])  # helm --set: "0.5"
    settings = load_settings(getattr(module, class_name), path, env_prefix=module.ENV_PREFIX, environ=POD_FIELDS)
    assert settings.heartbeat_interval_s == 0.5
