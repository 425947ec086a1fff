"""The chart's default mutual TLS with real processes: a scheduler started with the settings and
certificate files the chart renders (on loopback) admits the gateway's rendered certificate for
a gateway method and refuses the kvstore's, a caller without a certificate, and a certificate
from another render's CA. `helm upgrade` keeps the CA (the chart's `lookup`, answered here by a
Kubernetes API emulator) and signs new leaves that the old revision's scheduler still trusts.

Rendered and run here; not installed on a cluster."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from tests.helm.test_chart_settings import _pod_env
from tests.helm.tools import NAMESPACE, REPO, by_kind, helm_template, render, tls_channel, use_rendered_tls
from tests.ports import free_port
from tests.scheduler.support import SchedulerProcess, instance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KMOCK_CLUSTER = REPO / "tests" / "helm" / "kmock_cluster.py"
CA_SECRET = "crescent-internal-ca"


def _gateway_server_name(docs: list[dict]) -> str:
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "crescent-gateway")
    return _pod_env(gateway["spec"]["template"]["spec"]["containers"][0])["CRESCENT_GATEWAY_TLS__SERVER_NAME"]


def _stub(docs: list[dict], secret: str | None, address: str, directory: Path) -> scheduler_pb2_grpc.SchedulerStub:
    """A client presenting the rendered Secret's certificate (None: trusting the CA, presenting none)."""
    if secret is not None:
        return scheduler_pb2_grpc.SchedulerStub(tls_channel(docs, secret, address, directory / secret,
                                                            _gateway_server_name(docs)))
    ca = base64.b64decode(by_kind(docs, "Secret")[CA_SECRET]["data"]["ca.crt"])
    options = [("grpc.ssl_target_name_override", _gateway_server_name(docs))]
    return scheduler_pb2_grpc.SchedulerStub(
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=options))


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render()  # the defaults: no cert-manager, no allowPlaintext


def _start_scheduler(docs: list[dict], directory: Path) -> SchedulerProcess:
    """The scheduler with its rendered settings: the tls section as rendered, its files where the
    pod would mount them moved to ``directory``; loopback ports; no Kubernetes discovery."""
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])
    assert set(config["tls"]) == {"ca", "cert", "key", "server_name"}  # mutual TLS, no plaintext override
    use_rendered_tls(config, docs, "crescent-scheduler-tls", directory / "scheduler")
    port, admin_port = free_port(), free_port()
    config["listen"] = {"host": "127.0.0.1", "port": port, "admin_port": admin_port}
    config["discovery"] = {"enabled": False}
    path = directory / "scheduler.yaml"
    path.write_text(yaml.safe_dump(config))
    sched = SchedulerProcess(path, port, admin_port)
    sched.start()
    return sched


@pytest.fixture(scope="module")
def scheduler(rendered: list[dict], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    sched = _start_scheduler(rendered, tmp_path_factory.mktemp("rendered-tls"))
    yield sched
    sched.stop()


def test_the_gateways_rendered_certificate_may_call_gateway_methods(rendered, scheduler, tmp_path: Path) -> None:
    gateway = _stub(rendered, "crescent-gateway-tls", scheduler.address, tmp_path)
    assert _code(lambda: gateway.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)) == grpc.StatusCode.OK
    # Place gets past the access check and is answered (no instances yet: nowhere to place).
    assert _code(lambda: gateway.Place(scheduler_pb2.PlaceRequest(prompt_tokens=3), timeout=5)) == grpc.StatusCode.OK


def test_the_kvstores_rendered_certificate_is_refused_a_gateway_method(rendered, scheduler, tmp_path: Path) -> None:
    kvstore = _stub(rendered, "crescent-kvstore-tls", scheduler.address, tmp_path)
    with pytest.raises(grpc.RpcError) as refused:
        kvstore.Place(scheduler_pb2.PlaceRequest(prompt_tokens=3), timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role 'kvstore' may not call" in refused.value.details()
    assert _code(lambda: kvstore.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_a_prefill_certificate_registers_only_as_a_prefill(rendered, scheduler, tmp_path: Path) -> None:
    prefill = _stub(rendered, "crescent-prefill-tls", scheduler.address, tmp_path)
    assert _code(lambda: prefill.Register(instance("p-tls", "prefill"), timeout=5)) == grpc.StatusCode.OK
    assert _code(lambda: prefill.Register(instance("d-tls", "decode"), timeout=5)) == grpc.StatusCode.PERMISSION_DENIED


def test_no_certificate_or_another_renders_ca_is_refused_at_the_handshake(rendered, scheduler, tmp_path: Path) -> None:
    anonymous = _stub(rendered, None, scheduler.address, tmp_path)
    assert _code(lambda: anonymous.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)) == \
        grpc.StatusCode.UNAVAILABLE
    # `helm template` makes a new CA each time: a second render's gateway is a stranger.
    other = render(fresh=True)
    assert other != rendered
    stranger = _stub(other, "crescent-gateway-tls", scheduler.address, tmp_path / "other")
    assert _code(lambda: stranger.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)) == \
        grpc.StatusCode.UNAVAILABLE


# -- helm upgrade: the CA from the cluster -----------------------------------------------------------

@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Path, object]]:
    """A kubeconfig for a Kubernetes API emulator, and a CoreV1Api client of it."""
    kubernetes = pytest.importorskip("kubernetes")
    pytest.importorskip("kmock")
    proc = subprocess.Popen([sys.executable, str(KMOCK_CLUSTER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), f"kmock did not start (said {url!r})"
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "tester", "user": {"token": "unused"}}],
            "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE}}],
        }))
        api = kubernetes.config.new_client_from_config(config_file=str(path))
        yield path, kubernetes.client.CoreV1Api(api)
        api.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _upgrade_render(kubeconfig: Path) -> list[dict]:
    """What `helm upgrade` would apply: a render whose `lookup` reads the cluster (the emulator
    serves no OpenAPI document to validate against)."""
    result = helm_template("--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(kubeconfig))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _store(core, secret: dict, owned: bool = True) -> None:
    """Create ``secret`` in the cluster; ``owned``: with the marks Helm gives what it installs."""
    metadata = {**secret["metadata"], "namespace": NAMESPACE}
    if owned:
        metadata["annotations"] = {**metadata.get("annotations", {}),
                                   "meta.helm.sh/release-name": "crescent", "meta.helm.sh/release-namespace": NAMESPACE}
    core.create_namespaced_secret(NAMESPACE, {**secret, "metadata": metadata})


def test_an_upgrade_keeps_the_ca_and_the_old_scheduler_trusts_the_new_leaves(rendered, scheduler, cluster,
                                                                               tmp_path: Path) -> None:
    kubeconfig, core = cluster
    installed = by_kind(rendered, "Secret")[CA_SECRET]
    _store(core, installed)  # what the install left in the cluster
    upgraded = _upgrade_render(kubeconfig)
    assert by_kind(upgraded, "Secret")[CA_SECRET]["data"] == installed["data"]  # the same CA, key and all
    ca = x509.load_pem_x509_certificate(base64.b64decode(installed["data"]["tls.crt"]))
    for name in ("crescent-gateway-tls", "crescent-scheduler-tls"):
        old, new = by_kind(rendered, "Secret")[name]["data"], by_kind(upgraded, "Secret")[name]["data"]
        assert new["tls.crt"] != old["tls.crt"] and new["tls.key"] != old["tls.key"]  # signed afresh
        x509.load_pem_x509_certificate(base64.b64decode(new["tls.crt"])).verify_directly_issued_by(ca)
    # The old revision's scheduler (started from the install's files) admits the new gateway pod.
    gateway = _stub(upgraded, "crescent-gateway-tls", scheduler.address, tmp_path)
    assert _code(lambda: gateway.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)) == grpc.StatusCode.OK


def test_only_a_ca_the_chart_made_is_signed_with(rendered, cluster) -> None:
    kubeconfig, core = cluster
    installed = by_kind(rendered, "Secret")[CA_SECRET]
    unmarked = {**installed, "metadata": {k: v for k, v in installed["metadata"].items() if k != "annotations"}}
    _store(core, unmarked)  # the release's, but without the chart's crescent.io/internal-ca mark
    upgraded = by_kind(_upgrade_render(kubeconfig), "Secret")[CA_SECRET]
    assert upgraded["data"]["tls.key"] != installed["data"]["tls.key"]  # a new CA instead
    assert upgraded["metadata"]["annotations"]["crescent.io/internal-ca"] == "self-signed"


def test_switching_from_cert_manager_stops_at_its_leftover_ca_secret(rendered, cluster) -> None:
    """cert-manager leaves its Secrets behind when its Certificates go; Helm will not take them
    over, so the switch fails naming the Secret to delete (docs/security.md) rather than signing
    with a CA it did not make."""
    kubeconfig, core = cluster
    leftover = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": CA_SECRET, "annotations": {"cert-manager.io/certificate-name": CA_SECRET}},
                "data": by_kind(rendered, "Secret")[CA_SECRET]["data"]}
    _store(core, leftover, owned=False)
    result = helm_template("--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(kubeconfig))
    assert result.returncode != 0
    assert f'Secret "{CA_SECRET}"' in result.stderr and "cannot be imported" in result.stderr
