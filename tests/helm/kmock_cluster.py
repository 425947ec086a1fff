"""A Kubernetes API emulator (kmock) that `helm template --dry-run=server` accepts, as its own
process: it reports a Kubernetes version the chart supports and lists the kinds the chart renders
by default in its discovery documents (what Helm maps manifests with), and stores what tests
create, so the chart's `lookup` sees it.

Prints its URL on the first line of stdout, then serves until terminated.
"""

from __future__ import annotations

import asyncio
import os
import signal

import kmock

KINDS = {
    "v1/configmaps": "ConfigMap", "v1/secrets": "Secret", "v1/services": "Service",
    "v1/serviceaccounts": "ServiceAccount", "v1/persistentvolumeclaims": "PersistentVolumeClaim", "v1/pods": "Pod",
    "apps/v1/deployments": "Deployment", "apps/v1/daemonsets": "DaemonSet",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "rbac.authorization.k8s.io/v1/roles": "Role", "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
}
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.4", "platform": "linux/amd64"}


async def serve() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        emulator["get /version"] << VERSION
        for resource, kind in KINDS.items():
            emulator.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=set(VERBS))
        # kmock names the core group's version "/v1", which Helm cannot map kinds with.
        emulator["get /api/v1"] << {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": "v1", "resources": [
            {"name": r.rsplit("/", 1)[1], "singularName": "", "kind": kind, "namespaced": True, "verbs": VERBS}
            for r, kind in KINDS.items() if r.startswith("v1/")]}
        print(server.url, flush=True)
        await stop.wait()
        os._exit(0)


if __name__ == "__main__":
    asyncio.run(serve())
