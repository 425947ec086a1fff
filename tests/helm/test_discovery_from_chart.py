"""`scheduler.kubernetesDiscovery: true` end to end: the scheduler, started with the very config
the chart renders, discovers the chart's engine pods from their Services' EndpointSlices (served
by a Kubernetes API emulator) under the ids those pods register themselves with. It runs the
rendered mutual TLS (its certificate files written out; a prefill pod's certificate calls it)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from tests.helm.test_chart_settings import POD_FIELDS, _pod_env
from tests.helm.tools import NAMESPACE, REPO, by_kind, render, tls_channel, use_rendered_tls
from tests.ports import free_port
from tests.scheduler.support import SchedulerProcess, instance

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("kmock")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KMOCK_SERVER = REPO / "tests" / "scheduler" / "kmock_server.py"
PODS = {"prefill": ("crescent-prefill-g0-abcde", "10.1.2.3"), "decode": ("crescent-decode-g0-fghij", "10.1.2.4"),
        "aggregated": ("crescent-aggregated-g0-klmno", "10.1.2.5")}


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    proc = subprocess.Popen([sys.executable, str(KMOCK_SERVER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
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
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def endpoint_slice(service: dict[str, Any], container: dict[str, Any], pod: str, ip: str) -> dict[str, Any]:
    """What the endpoint controller publishes for one ready pod behind ``service``."""
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    name = service["metadata"]["name"]
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{name}-abc12", "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": name}},
        "ports": [{"name": p["name"], "port": container_ports[p["targetPort"]], "protocol": "TCP"}
                  for p in service["spec"]["ports"]],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE}}],
    }


def listed(sched: SchedulerProcess) -> dict[str, scheduler_pb2.InstanceInfo]:
    reply = sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest())
    return {s.info.instance_id: s.info for s in reply.instances}


def test_the_rendered_scheduler_discovers_the_rendered_engine_pods(tmp_path: Path, kubeconfig: Path) -> None:
    docs = render("--set", "aggregated.enabled=true")  # beside the pools: all three engine roles
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])
    port, admin_port = free_port(), free_port()
    config["listen"] = {"host": "127.0.0.1", "port": port, "admin_port": admin_port}  # loopback, not 0.0.0.0:50051
    config["discovery"]["kubeconfig"] = str(kubeconfig)  # in a pod: the mounted service account token
    use_rendered_tls(config, docs, "crescent-scheduler-tls", tmp_path / "scheduler-tls")
    (tmp_path / "scheduler.yaml").write_text(yaml.safe_dump(config))

    api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    services = by_kind(docs, "Service")
    expected: dict[str, tuple[str, str]] = {}  # instance id -> (role, address), as each pod registers
    for role, (pod, ip) in PODS.items():
        workload = next(d for d in docs if d["kind"] == "Deployment"
                        and d["metadata"]["labels"]["app.kubernetes.io/component"] == role)
        container = workload["spec"]["template"]["spec"]["containers"][0]
        # The pod's environment, with this pod's name and IP for the downward API's.
        env = {k: v.replace(POD_FIELDS["POD_NAME"], pod).replace(POD_FIELDS["POD_IP"], ip)
               for k, v in _pod_env(container).items()}
        expected[env[f"CRESCENT_{role.upper()}__INSTANCE_ID"]] = (role, env[f"CRESCENT_{role.upper()}__ADVERTISE_ADDRESS"])
        service = services[config["discovery"][f"{role}_service"]]
        kubernetes.client.DiscoveryV1Api(api).create_namespaced_endpoint_slice(
            NAMESPACE, endpoint_slice(service, container, pod, ip)
        )
    api.close()

    sched = SchedulerProcess(tmp_path / "scheduler.yaml", port, admin_port)
    sched.start()
    # A prefill pod's rendered certificate: it may list instances and register as a prefill.
    sched.channel.close()
    sched.channel = tls_channel(docs, "crescent-prefill-tls", sched.address, tmp_path / "prefill-tls",
                                config["tls"]["server_name"])
    sched.stub = scheduler_pb2_grpc.SchedulerStub(sched.channel)
    try:
        deadline = time.monotonic() + 15
        while set(listed(sched)) != set(expected):
            assert time.monotonic() < deadline, f"discovered {sorted(listed(sched))}, expected {sorted(expected)}"
            time.sleep(0.1)
        roles = {scheduler_pb2.INSTANCE_ROLE_PREFILL: "prefill", scheduler_pb2.INSTANCE_ROLE_DECODE: "decode",
                 scheduler_pb2.INSTANCE_ROLE_AGGREGATED: "aggregated"}
        assert {i: (roles[info.role], info.address) for i, info in listed(sched).items()} == expected
        # The pod's own registration lands on the discovered entry: still one instance per pod.
        prefill_id = next(i for i, (role, _) in expected.items() if role == "prefill")
        own = instance(prefill_id, "prefill", model_id=config["discovery"]["model_id"],
                       block_size=config["discovery"].get("block_size", DEFAULT_BLOCK_SIZE), kv_capacity_tokens=4096)
        own.address = expected[prefill_id][1]
        sched.stub.Register(own)
        time.sleep(0.5)
        after = listed(sched)
        assert set(after) == set(expected) and after[prefill_id].kv_capacity_tokens == 4096
    finally:
        sched.stop()
