"""The chart's internal mutual TLS. By default (no cert-manager) the chart makes a CA and one
certificate per component in the Secrets cert-manager would write; every pod mounts its own and
none the CA's. With cert-manager: a CA, an Issuer and one Certificate per component naming its
role. Plaintext renders only with internalTls.allowPlaintext. A real scheduler started with the
rendered files: tests/helm/test_self_signed_tls.py."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from crescent.services.common.access import ACCESS, Peer, identity_of_cert
from crescent.services.common.settings import load_settings
from crescent.services.common.tls import TlsSettings, check_listen
from tests.helm.test_chart_settings import SETTINGS, _pod_env
from tests.helm.test_multinode import MULTI
from tests.helm.tools import by_kind, helm_template, notes, render

COMPONENTS = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore")
GRPC_SERVERS = COMPONENTS[1:]  # the gateway serves HTTP; it is only a gRPC client
# Aggregated engines are off by default; these tests turn them on beside the pools.
AGGREGATED = ["--set", "aggregated.enabled=true"]
CERT_MANAGER = ["--set", "internalTls.certManager.enabled=true", "--set", "internalTls.certManager.adminCertificate=true",
                *AGGREGATED]
PLAINTEXT = ["--set", "internalTls.selfSigned.enabled=false", "--set", "internalTls.allowPlaintext=true"]
SETTINGS_OF = SETTINGS  # every role, aggregated included (contract/roles.py)
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")


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


def _pem(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def _pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod template the chart renders, by "<kind>/<name>[/leader|/worker]"."""
    specs = {}
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            specs[name] = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "Pod":
            specs[name] = doc["spec"]
        elif doc["kind"] == "LeaderWorkerSet":
            template = doc["spec"]["leaderWorkerTemplate"]
            specs[f"{name}/worker"] = template["workerTemplate"]["spec"]
            if "leaderTemplate" in template:
                specs[f"{name}/leader"] = template["leaderTemplate"]["spec"]
    return specs


def _mounted_secrets(pod: dict) -> set[str]:
    names = set()
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def test_by_default_every_service_runs_mutual_tls_from_its_own_self_signed_certificate(tmp_path: Path) -> None:
    docs = render(*AGGREGATED)
    assert not by_kind(docs, "Certificate") and not by_kind(docs, "Issuer")  # no cert-manager needed
    rendered = "\n".join(str(d) for d in docs)
    assert "allow_plaintext_non_loopback" not in rendered
    secrets = by_kind(docs, "Secret")
    ca_secret = secrets["crescent-internal-ca"]
    ca = x509.load_pem_x509_certificate(_pem(ca_secret, "tls.crt"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert set(ca_secret["data"]) == set(TLS_FILES) and ca_secret["type"] == "kubernetes.io/tls"
    for component in COMPONENTS:
        secret = secrets[f"crescent-{component}-tls"]
        assert set(secret["data"]) == set(TLS_FILES) and secret["type"] == "kubernetes.io/tls"
        assert _pem(secret, "ca.crt") == _pem(ca_secret, "tls.crt")
        leaf = x509.load_pem_x509_certificate(_pem(secret, "tls.crt"))
        leaf.verify_directly_issued_by(ca)
        assert identity_of_cert(_pem(secret, "tls.crt")) == Peer(component, "")  # the role, from the CN
        dns = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert dns == ["crescent-internal", f"crescent-{component}", f"crescent-{component}.serving.svc"]
        # ECDSA P-256 like cert-manager's; the key matches the certificate.
        key = load_pem_private_key(_pem(secret, "tls.key"), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert key.public_key().public_numbers() == leaf.public_key().public_numbers()

        pod = _workload(docs, component)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        assert volume["secret"]["secretName"] == f"crescent-{component}-tls"
        assert volume["secret"]["defaultMode"] == 0o440  # root-owned, group fsGroup: the service only
        settings, container = _settings(tmp_path, docs, component)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        if component == "gateway":
            tls = load_settings(TlsSettings, env_prefix="CRESCENT_GATEWAY_TLS", environ=_pod_env(container))
        else:
            tls = settings.tls
            assert settings.listen.host == "0.0.0.0" and not tls.allow_plaintext_non_loopback
            check_listen(component, settings.listen.host, tls)  # mutual TLS: 0.0.0.0 is fine
        assert tls.enabled and tls.server_name in dns
        assert {Path(getattr(tls, f)).name for f in ("ca", "cert", "key")} == set(TLS_FILES)
        assert all(Path(getattr(tls, f)).parent == Path(mounts["internal-tls"]) for f in ("ca", "cert", "key"))
    # Client-only certificates only when asked for.
    assert "crescent-admin-tls" not in secrets and "crescent-proxy-tls" not in secrets


@pytest.mark.parametrize("values", [AGGREGATED, CERT_MANAGER, MULTI, [*AGGREGATED, "--set", "inferenceExtension.enabled=true"]],
                         ids=["self-signed", "cert-manager", "multi-node", "inference-extension"])
def test_no_pod_mounts_the_ca_and_each_mounts_only_its_own_certificate(values: list[str]) -> None:
    docs = render(*values)
    specs = _pod_specs(docs)
    assert any(k.startswith("LeaderWorkerSet/") for k in specs) == (values is MULTI)
    for name, pod in specs.items():
        mounted = _mounted_secrets(pod)
        assert "crescent-internal-ca" not in mounted, name
        tls = {s for s in mounted if s.endswith("-tls")}
        component = name.split("/")[1].removeprefix("crescent-").split("-")[0]
        assert tls <= {f"crescent-{component}-tls"}, (name, tls)
    # No service account may read Secrets through the API either.
    for kind in ("Role", "ClusterRole"):
        for role in by_kind(docs, kind).values():
            assert all("secrets" not in rule.get("resources", []) for rule in role["rules"]), role["metadata"]["name"]


def test_client_certificates_for_admin_tools_and_the_proxy_only_when_asked() -> None:
    docs = render("--set", "internalTls.selfSigned.adminCertificate=true", "--set", "inferenceExtension.enabled=true")
    secrets = by_kind(docs, "Secret")
    assert identity_of_cert(_pem(secrets["crescent-admin-tls"], "tls.crt")) == Peer("admin", "")
    assert identity_of_cert(_pem(secrets["crescent-proxy-tls"], "tls.crt")) == Peer("proxy", "")
    # The scheduler serves the endpoint picker too: its certificate names the picker's Service.
    scheduler = x509.load_pem_x509_certificate(_pem(secrets["crescent-scheduler-tls"], "tls.crt"))
    dns = scheduler.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"crescent-endpoint-picker", "crescent-endpoint-picker.serving.svc"} <= set(dns)


def test_plaintext_without_allow_plaintext_refuses_to_render_and_names_the_value() -> None:
    result = helm_template("--set", "internalTls.selfSigned.enabled=false")
    assert result.returncode != 0
    assert "internalTls.allowPlaintext=true" in result.stderr
    assert "internalTls.selfSigned.enabled=true" in result.stderr and "internalTls.certManager.enabled=true" in result.stderr
    assert "scheduler, prefill, decode, kvstore would serve plaintext gRPC" in result.stderr


def test_certificates_may_not_outlive_the_ca() -> None:
    result = helm_template("--set", "internalTls.selfSigned.days=400", "--set", "internalTls.selfSigned.caDays=365")
    assert result.returncode != 0 and "internalTls.selfSigned.days (400) must not exceed" in result.stderr
    assert helm_template("--set", "internalTls.selfSigned.days=0").returncode != 0  # the schema's minimum


def test_allow_plaintext_still_renders_the_explicit_override(tmp_path: Path) -> None:
    docs = render(*PLAINTEXT, *AGGREGATED)
    assert not by_kind(docs, "Secret") and not by_kind(docs, "Certificate")
    for component in GRPC_SERVERS:
        settings, container = _settings(tmp_path, docs, component)
        assert settings.listen.host == "0.0.0.0" and not settings.tls.enabled
        assert settings.tls.allow_plaintext_non_loopback
        check_listen(component, settings.listen.host, settings.tls)  # would start, with a warning
    assert all("internal-tls" not in str(pod) for pod in _pod_specs(docs).values())
    assert "WARNING internal gRPC is PLAINTEXT" in notes(*PLAINTEXT)
    assert "mutual TLS with the chart's own CA" in notes() and "PLAINTEXT" not in notes()


def test_settings_tls_of_their_own_render_without_allow_plaintext(tmp_path: Path) -> None:
    own = {"ca": "/etc/own/ca.pem", "cert": "/etc/own/tls.pem", "key": "/etc/own/key.pem"}
    args = ["--set", "internalTls.selfSigned.enabled=false"]
    for component in ("scheduler", "prefill", "decode"):
        args += ["--set-json", f'{component}.settings.tls={{"ca": "{own["ca"]}", "cert": "{own["cert"]}", "key": "{own["key"]}"}}']
    missing = helm_template(*args)
    assert missing.returncode != 0 and "internalTls: kvstore would serve plaintext gRPC" in missing.stderr
    docs = render(*args, "--set", "kvstore.enabled=false")
    settings, _ = _settings(tmp_path, docs, "scheduler")
    assert settings.tls.cert == own["cert"] and not settings.tls.allow_plaintext_non_loopback


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
    needed = {role for rules in ACCESS.values() for rule in rules.values() for role in rule.roles}
    # The proxy role's is issued with the inference extension.
    docs = render(*CERT_MANAGER, "--set", "inferenceExtension.enabled=true")
    issued = {uri.rsplit("/", 1)[-1] for c in by_kind(docs, "Certificate").values() for uri in c["spec"].get("uris", [])}
    assert needed <= issued
    docs = render(*AGGREGATED, "--set", "internalTls.selfSigned.adminCertificate=true", "--set", "inferenceExtension.enabled=true")
    peers = [identity_of_cert(_pem(s, "tls.crt")) for name, s in by_kind(docs, "Secret").items() if name.endswith("-tls")]
    assert needed <= {peer.role for peer in peers if peer is not None}
