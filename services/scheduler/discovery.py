"""Discovering engine instances (prefill, decode, aggregated) from Kubernetes EndpointSlices.

Registration (instances call ``Register`` and heartbeat) works anywhere; in a cluster the
scheduler can also learn membership from the EndpointSlices of the engines' Services:

- a ready endpoint that is not registered yet is registered with the details in the settings
  (model, block size), so it can take requests before its own registration arrives; its own
  ``Register`` later replaces those details (the instance id is the same: ``<role>-<pod>-<port>``,
  the instance's default id, since a pod's hostname is its name);
- while an endpoint stays ready it counts as alive, heartbeats or not;
- when its endpoint is gone or terminating, the instance is dropped at once, without waiting
  for the heartbeat timeout.

The watcher lists the slices, then follows a ``?watch=true`` stream; a stream that ends, times
out (``watch_timeout_s`` without events) or fails is followed by a fresh list, which also
resyncs anything missed. The ``kubernetes`` client is blocking, so it runs on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import DiscoverySettings
from crescent.services.scheduler.datatypes import InstanceId, Role
from crescent.services.scheduler.registry import InstanceSpec

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def watched_services(settings: DiscoverySettings) -> dict[str, Role]:
    """Service name -> the role of its endpoints (a name left empty is not watched)."""
    named = ((settings.prefill_service, Role.PREFILL), (settings.decode_service, Role.DECODE),
             (settings.aggregated_service, Role.AGGREGATED))
    return {name: role for name, role in named if name}


@dataclass(frozen=True, slots=True)
class DiscoveredEndpoint:
    instance_id: InstanceId
    role: Role
    address: str            # host:port of the instance's gRPC server
    ready: bool


def endpoints_of(slice_: Mapping[str, Any], role: Role, port_name: str) -> list[DiscoveredEndpoint]:
    """The instances one EndpointSlice (as JSON) describes; terminating endpoints are left out."""
    port = next((p.get("port") for p in slice_.get("ports") or [] if p.get("name", "") == port_name), None)
    if not port:
        return []
    found = []
    for endpoint in slice_.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("terminating"):
            continue
        ready = conditions.get("ready") is not False  # unknown readiness counts as ready (API docs)
        pod = (endpoint.get("targetRef") or {}).get("name")
        for ip in endpoint.get("addresses") or []:
            host = f"[{ip}]" if ":" in ip else ip
            name = pod or ip
            found.append(DiscoveredEndpoint(InstanceId(f"{role.value}-{name}-{port}"), role, f"{host}:{port}", ready))
    return found


class SliceTracker:
    """The slices of the watched Services, kept current from list results and watch events."""

    def __init__(self, settings: DiscoverySettings) -> None:
        self._roles = watched_services(settings)
        self._port_name = settings.port_name
        self._slices: dict[str, list[DiscoveredEndpoint]] = {}

    def _role(self, slice_: Mapping[str, Any]) -> Role | None:
        labels = (slice_.get("metadata") or {}).get("labels") or {}
        return self._roles.get(labels.get(SERVICE_NAME_LABEL, ""))

    @staticmethod
    def _key(slice_: Mapping[str, Any]) -> str:
        meta = slice_.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    def reset(self, slices: Iterable[Mapping[str, Any]]) -> None:
        self._slices = {}
        for slice_ in slices:
            self.apply("ADDED", slice_)

    def apply(self, kind: str, slice_: Mapping[str, Any]) -> None:
        role = self._role(slice_)  # filtered here too: not every API server honours label selectors
        if role is None:
            return
        if kind == "DELETED":
            self._slices.pop(self._key(slice_), None)
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[self._key(slice_)] = endpoints_of(slice_, role, self._port_name)

    def endpoints(self) -> dict[InstanceId, DiscoveredEndpoint]:
        """Every endpoint; one listed both ready and not (two slices) counts as ready."""
        merged: dict[InstanceId, DiscoveredEndpoint] = {}
        for endpoints in self._slices.values():
            for e in endpoints:
                if e.instance_id not in merged or e.ready:
                    merged[e.instance_id] = e
        return merged


class DiscoveredMembership:
    """Applies discovered endpoints to the Conductor's registry (see the module docstring)."""

    def __init__(self, conductor: Conductor, settings: DiscoverySettings) -> None:
        self.conductor = conductor
        self.settings = settings
        self.endpoints: dict[InstanceId, DiscoveredEndpoint] = {}

    def update(self, endpoints: dict[InstanceId, DiscoveredEndpoint]) -> None:
        for instance_id in self.endpoints.keys() - endpoints.keys():
            if self.conductor.deregister(instance_id):
                log.info("instance %s left its Service's endpoints; dropped", instance_id)
        self.endpoints = dict(endpoints)
        registry = self.conductor.registry
        # An instance registered under another id (e.g. a configured one) at the same address is the same instance.
        known_addresses = {r.spec.address for r in registry.all()}
        for e in endpoints.values():
            if e.ready and registry.get(e.instance_id) is None and e.address not in known_addresses:
                s = self.settings
                self.conductor.register(InstanceSpec(e.instance_id, e.role, e.address, s.model_id, s.block_size,
                                                     kv_capacity_tokens=0, max_batch_size=0), assumed=True)
                log.info("discovered %s instance %s at %s", e.role.value, e.instance_id, e.address)

    def keep_alive(self) -> None:
        """Ready endpoints count as alive between heartbeats (or without any)."""
        for e in self.endpoints.values():
            if e.ready:
                self.conductor.registry.touch(e.instance_id)


class EndpointSliceWatcher:
    """Lists and watches the slices on a thread; calls ``on_change`` on the event loop."""

    def __init__(self, settings: DiscoverySettings,
                 on_change: Callable[[dict[InstanceId, DiscoveredEndpoint]], None]) -> None:
        self.settings = settings
        self.tracker = SliceTracker(settings)
        self._on_change = on_change
        self._api: Any = None
        self._response: Any = None
        self.synced = asyncio.Event()   # set after the first successful list

    def _client(self) -> Any:
        from kubernetes import client, config  # optional dependency: only when discovery is on

        if self.settings.kubeconfig:
            return config.new_client_from_config(config_file=self.settings.kubeconfig)
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)

    def _selector(self) -> str:
        return f"{SERVICE_NAME_LABEL} in ({','.join(watched_services(self.settings))})"

    def _list(self) -> tuple[list[dict[str, Any]], str]:
        from kubernetes import client

        if self._api is None:
            self._api = self._client()
        reply = client.DiscoveryV1Api(self._api).list_namespaced_endpoint_slice(
            self.settings.namespace, label_selector=self._selector(), _request_timeout=self.settings.watch_timeout_s
        )
        slices = [self._api.sanitize_for_serialization(item) for item in reply.items]
        return slices, (reply.metadata.resource_version or "") if reply.metadata else ""

    def _watch(self, resource_version: str, loop: asyncio.AbstractEventLoop) -> None:
        """Follow the watch stream until it ends or times out; events go to the loop thread."""
        query = [("watch", "true"), ("labelSelector", self._selector()), ("allowWatchBookmarks", "true")]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        response = self._api.call_api(
            SLICES_PATH, "GET", path_params={"namespace": self.settings.namespace}, query_params=query,
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
            _preload_content=False, _request_timeout=(10, self.settings.watch_timeout_s),
        )
        self._response = response = response[0] if isinstance(response, tuple) else response
        try:
            pending = b""
            for data in response.stream(64 * 1024, decode_content=True):
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":  # e.g. 410 Gone: the version is too old; list again
                        log.info("EndpointSlice watch ended: %s", (event.get("object") or {}).get("message", ""))
                        return
                    loop.call_soon_threadsafe(self._event, event)
        finally:
            self._response = None
            response.release_conn()

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
            self.tracker.apply(event["type"], event.get("object") or {})
            self._on_change(self.tracker.endpoints())

    async def run(self) -> None:
        """List, publish, watch; again after every end or failure. Cancel to stop."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    slices, version = await asyncio.to_thread(self._list)
                    self.tracker.reset(slices)
                    self._on_change(self.tracker.endpoints())
                    self.synced.set()
                    started = loop.time()
                    await asyncio.to_thread(self._watch, version, loop)
                    if loop.time() - started < self.settings.retry_delay_s:  # a server that ends watches at once
                        await asyncio.sleep(self.settings.retry_delay_s)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - any client or network failure: retry, never die
                    if not _is_read_timeout(exc):
                        status = getattr(exc, "status", None)  # an API error: its status, not its whole body
                        what = f"HTTP {status} {getattr(exc, 'reason', '')}" if status else f"{type(exc).__name__}: {exc}"
                        log.warning("EndpointSlice discovery in namespace %s failed (%s); retrying",
                                    self.settings.namespace, what)
                        await asyncio.sleep(self.settings.retry_delay_s)
        finally:
            self.close()

    def close(self) -> None:
        """Unblock a watch in progress (its thread ends) and drop the client."""
        response = self._response
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:  # closing alone does not wake a thread blocked reading the socket
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._api is not None:
            self._api.close()
            self._api = None


def _is_read_timeout(exc: BaseException) -> bool:
    """A quiet watch: the normal way a stream ends here, followed by a fresh list."""
    from urllib3.exceptions import ProtocolError, ReadTimeoutError

    return isinstance(exc, ReadTimeoutError) or (isinstance(exc, ProtocolError) and "timed out" in str(exc))
