"""The chart's internal mutual TLS: off, the services get the explicit plaintext override (they
refuse plaintext on 0.0.0.0 otherwise); with cert-manager, a CA, one Certificate per component
naming its role, each pod mounting its own Secret, and settings that turn mutual TLS on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from crescent.services.common.access import ACCESS
from crescent.services.common.settings import load_settings
from crescent.services.common.tls import TlsSettings, check_listen
from tests.helm.test_chart_settings import SETTINGS, _pod_env
from tests.helm.tools import by_kind, render

COMPONENTS = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore")
# Aggregated engines are off by default; these tests turn them on beside the pools.
CERT_MANAGER = ["--set", "internalTls.certManager.enabled=true", "--set", "internalTls.certManager.adminCertificate=true",
                "--set", "aggregated.enabled=true"]
SETTINGS_OF = {**SETTINGS, "aggregated": ("crescent.services.aggregated.config", "AggregatedSettings")}


def _workload(docs: list[dict], component: str) -> dict:
    return next(d for d in docs if d["kind"] in ("Deployment", "DaemonSet")
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def _settings(tmp_path: Path, docs: list[dict], component: str):
    import importlib

    module_name, class_name = SETTINGS_OF[component]
    module = importlib.import_module(module_name)
    path = tmp_path / f"{component}.yaml"
    path.write_text(by_kind(docs, "ConfigMap")[f"crescent-{component}"]["data"]["config.yaml"])
    container = _workload(docs, component)["spec"]["template"]["spec"]["containers"][0]
    return load_settings(getattr(module, class_name), path, env_prefix=module.ENV_PREFIX,
                         environ=_pod_env(container)), container


def test_by_default_the_grpc_services_get_the_plaintext_override_and_no_certificates(tmp_path: Path) -> None:
    docs = render("--set", "aggregated.enabled=true")
    assert not by_kind(docs, "Certificate") and not by_kind(docs, "Issuer")
    for component in ("scheduler", "prefill", "decode", "aggregated", "kvstore"):
        settings, _ = _settings(tmp_path, docs, component)
        assert settings.listen.host == "0.0.0.0" and not settings.tls.enabled
        assert settings.tls.allow_plaintext_non_loopback
        check_listen(component, settings.listen.host, settings.tls)  # would start


def test_without_the_override_plaintext_pods_would_refuse_to_start(tmp_path: Path) -> None:
    docs = render("--set", "internalTls.allowPlaintext=false")
    settings, _ = _settings(tmp_path, docs, "scheduler")
    with pytest.raises(Exception, match="refusing to serve plaintext"):
        check_listen("scheduler", settings.listen.host, settings.tls)


def test_cert_manager_issues_a_certificate_per_role_and_every_pod_uses_its_own(tmp_path: Path) -> None:
    docs = render(*CERT_MANAGER)
    issuers = by_kind(docs, "Issuer")
    certificates = by_kind(docs, "Certificate")
    assert issuers["crescent-selfsigned"]["spec"] == {"selfSigned": {}}
    assert issuers["crescent-internal-ca"]["spec"]["ca"]["secretName"] == "crescent-internal-ca"
    assert certificates["crescent-internal-ca"]["spec"]["isCA"] is True
    assert certificates["crescent-admin"]["spec"]["uris"] == ["spiffe://crescent/admin"]
    for component in COMPONENTS:
        cert = certificates[f"crescent-{component}"]["spec"]
        assert cert["uris"] == [f"spiffe://crescent/{component}"]  # the role the servers check
        assert cert["issuerRef"]["name"] == "crescent-internal-ca"
        assert {"server auth", "client auth"} <= set(cert["usages"])
        pod = _workload(docs, component)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        assert volume["secret"]["secretName"] == cert["secretName"]
        settings, container = _settings(tmp_path, docs, component)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        if component == "gateway":
            env = _pod_env(container)
            tls = load_settings(TlsSettings, env_prefix="CRESCENT_GATEWAY_TLS", environ=env)
        else:
            tls = settings.tls
            check_listen(component, settings.listen.host, tls)  # mutual TLS: 0.0.0.0 is fine
            assert not tls.allow_plaintext_non_loopback
        assert tls.enabled and tls.server_name in cert["dnsNames"]
        assert all(Path(getattr(tls, f)).parent == Path(mounts["internal-tls"]) for f in ("ca", "cert", "key"))


def test_every_role_the_access_table_names_has_a_certificate_in_the_chart() -> None:
    docs = render(*CERT_MANAGER, "--set", "inferenceExtension.enabled=true")  # the proxy role's is issued with it
    issued = {uri.rsplit("/", 1)[-1] for c in by_kind(docs, "Certificate").values() for uri in c["spec"].get("uris", [])}
    needed = {role for rules in ACCESS.values() for rule in rules.values() for role in rule.roles}
    assert needed <= issued
