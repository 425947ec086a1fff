"""EndpointSlice discovery: a real scheduler process watching a Kubernetes API emulator (kmock).

kmock runs as its own process on loopback; the test writes EndpointSlices with the official
``kubernetes`` client, as the endpoint controller would, and watches the scheduler's registry
through its gRPC ``ListInstances`` and ``Place``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from crescent.protos import scheduler_pb2
from crescent.services.scheduler.datatypes import Role
from crescent.services.scheduler.config import DiscoverySettings
from crescent.services.scheduler.discovery import EndpointSliceWatcher, SliceTracker, endpoints_of

from .support import free_port, instance

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("kmock")

pytestmark = pytest.mark.timeout(120)

NAMESPACE = "serving"
KMOCK_SERVER = Path(__file__).with_name("kmock_server.py")


def endpoint_slice(name: str, service: str, pods: list[tuple[str, str]], *, ready: bool = True,
                   terminating: bool = False, port_name: str = "grpc", port: int = 50051) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "metrics", "port": 9000, "protocol": "TCP"}, {"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
             "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE}}
            for pod, ip in pods
        ],
    }


# ---- parsing (no network) ------------------------------------------------------------------

def test_endpoints_of_a_slice_name_instances_like_their_own_default_ids() -> None:
    slice_ = endpoint_slice("p-1", "crescent-prefill", [("prefill-7f9c", "10.1.0.4")])
    slice_["endpoints"].append({"addresses": ["fd00::5"], "conditions": {}})  # no pod, unknown readiness
    slice_["endpoints"].append({"addresses": ["10.1.0.9"], "conditions": {"ready": False, "terminating": True}})
    found = endpoints_of(slice_, Role.PREFILL, "grpc")
    assert [(e.instance_id, e.address, e.ready) for e in found] == [
        ("prefill-prefill-7f9c-50051", "10.1.0.4:50051", True),
        ("prefill-fd00::5-50051", "[fd00::5]:50051", True),
    ]
    assert endpoints_of(slice_, Role.PREFILL, "no-such-port") == []


def test_tracker_ignores_other_services_and_forgets_deleted_slices() -> None:
    tracker = SliceTracker(DiscoverySettings(enabled=True))
    tracker.reset([
        endpoint_slice("p-1", "crescent-prefill", [("p0", "10.0.0.1")]),
        endpoint_slice("x-1", "unrelated", [("x0", "10.0.0.9")]),
    ])
    tracker.apply("ADDED", endpoint_slice("d-1", "crescent-decode", [("d0", "10.0.0.2")], ready=False))
    tracker.apply("ADDED", endpoint_slice("a-1", "crescent-aggregated", [("a0", "10.0.0.3")]))
    assert {i: (e.role, e.ready) for i, e in tracker.endpoints().items()} == {
        "prefill-p0-50051": (Role.PREFILL, True), "decode-d0-50051": (Role.DECODE, False),
        "aggregated-a0-50051": (Role.AGGREGATED, True),
    }
    tracker.apply("DELETED", endpoint_slice("p-1", "crescent-prefill", []))
    assert set(tracker.endpoints()) == {"decode-d0-50051", "aggregated-a0-50051"}


def test_a_service_name_left_empty_is_not_watched() -> None:
    settings = DiscoverySettings(enabled=True, aggregated_service="")
    tracker = SliceTracker(settings)
    tracker.reset([endpoint_slice("a-1", "", [("a0", "10.0.0.3")])])  # a slice without the label
    assert tracker.endpoints() == {}
    assert EndpointSliceWatcher(settings, lambda _: None)._selector() == (
        "kubernetes.io/service-name in (crescent-prefill,crescent-decode)")


# ---- a scheduler process watching kmock ----------------------------------------------------

@pytest.fixture
def kube_api() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(KMOCK_SERVER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"kmock did not start (said {url!r})")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def kubeconfig(kube_api: str, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "kmock", "cluster": {"server": kube_api}}],
        "users": [{"name": "tester", "user": {"token": "unused"}}],
        "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE}}],
    }))
    return path


@pytest.fixture
def slices(kubeconfig: Path) -> Iterator:
    api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    yield kubernetes.client.DiscoveryV1Api(api)
    api.close()


def listed(sched) -> dict[str, scheduler_pb2.InstanceStatus]:
    return {s.info.instance_id: s for s in sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest()).instances}


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def start_discovering(start_scheduler, kubeconfig: Path, **extra):
    return start_scheduler(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=0.6,
        discovery={"enabled": True, "kubeconfig": str(kubeconfig), "namespace": NAMESPACE, "model_id": "m",
                   "block_size": 4, "watch_timeout_s": 30, "retry_delay_s": 0.2, **extra},
    )


@pytest.mark.slow
def test_instances_come_and_go_with_their_endpoints(start_scheduler, kubeconfig, slices) -> None:
    slices.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice("pf-a", "crescent-prefill", [("pf-0", "10.0.0.1")]))
    sched = start_discovering(start_scheduler, kubeconfig)
    eventually(lambda: "prefill-pf-0-50051" in listed(sched), "the existing slice is listed")

    # Slices created after start arrive through the watch; other Services are not instances.
    slices.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice("dc-a", "crescent-decode", [("dc-0", "10.0.0.2")]))
    slices.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice("db-a", "postgres", [("db-0", "10.0.0.3")]))
    eventually(lambda: "decode-dc-0-50051" in listed(sched), "the new decode endpoint is registered")
    found = listed(sched)
    assert set(found) == {"prefill-pf-0-50051", "decode-dc-0-50051"}
    assert found["decode-dc-0-50051"].info.address == "10.0.0.2:50051"
    assert found["decode-dc-0-50051"].info.role == scheduler_pb2.INSTANCE_ROLE_DECODE

    # Ready endpoints stay placeable without heartbeats, well past the heartbeat timeout.
    time.sleep(1.5)
    placement = sched.stub.Place(scheduler_pb2.PlaceRequest(request_id="r1", model_id="m", prompt_tokens=64, max_tokens=8))
    assert not placement.HasField("rejection"), placement.rejection.message
    assert (placement.prefill.address, placement.decode.address) == ("10.0.0.1:50051", "10.0.0.2:50051")

    # A terminating endpoint is dropped at once; so is every endpoint of a deleted slice.
    slices.patch_namespaced_endpoint_slice("dc-a", NAMESPACE, endpoint_slice("dc-a", "crescent-decode", [("dc-0", "10.0.0.2")],
                                                                             ready=False, terminating=True))
    eventually(lambda: "decode-dc-0-50051" not in listed(sched), "the terminating decode endpoint is dropped", 2.0)
    assert sched.stub.Place(scheduler_pb2.PlaceRequest(request_id="r2", model_id="m", prompt_tokens=64)).rejection.reason \
        == "no_decode_instance"
    slices.delete_namespaced_endpoint_slice("pf-a", NAMESPACE)
    eventually(lambda: not listed(sched), "the deleted slice's prefill instance is dropped", 2.0)


@pytest.mark.slow
def test_an_instance_that_registers_itself_keeps_its_own_details(start_scheduler, kubeconfig, slices) -> None:
    sched = start_discovering(start_scheduler, kubeconfig)
    slices.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice("pf-b", "crescent-prefill", [("pf-1", "10.0.0.7")]))
    eventually(lambda: "prefill-pf-1-50051" in listed(sched), "the endpoint is discovered")
    assert listed(sched)["prefill-pf-1-50051"].info.kv_capacity_tokens == 0  # not known from Kubernetes

    own = instance("prefill-pf-1-50051", "prefill", kv_capacity_tokens=123_456)
    own.address = "10.0.0.7:50051"
    sched.stub.Register(own)
    time.sleep(0.5)  # a few watch/keep-alive rounds: discovery must not overwrite the registration
    assert listed(sched)["prefill-pf-1-50051"].info.kv_capacity_tokens == 123_456

    # Not ready (but not terminating): discovery does not add it, nor does it evict a registered one.
    slices.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice("pf-c", "crescent-prefill", [("pf-2", "10.0.0.8")],
                                                                      ready=False))
    time.sleep(0.5)
    assert set(listed(sched)) == {"prefill-pf-1-50051"}

    # A scheduler in the middle of a watch still stops promptly (a pod being replaced).
    started = time.monotonic()
    sched.stop()
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_the_scheduler_keeps_serving_while_the_api_server_is_unreachable(start_scheduler, tmp_path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],  # nothing listens
        "users": [{"name": "u", "user": {}}], "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}],
    }))
    sched = start_discovering(start_scheduler, config)
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    placement = sched.stub.Place(scheduler_pb2.PlaceRequest(request_id="r", model_id="m", prompt_tokens=64))
    assert placement.prefill.instance_id == "p0"
