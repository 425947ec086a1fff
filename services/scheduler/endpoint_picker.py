"""The endpoint picker of a Gateway API Inference Extension ``InferencePool``, without the network.

A proxy (Envoy Gateway, Istio, kgateway) asks the picker, for every request routed to the pool,
which pod to send it to. Which pods are those in Crescent? Only the gateways speak the OpenAI
HTTP API the proxy forwards; prefill and decode pods speak Crescent's gRPC, and the request's
prefix block keys need the tenant's cache salt (a secret derived from its API key, held by the
gateway) and the model's tokenizer. So the pool is the gateway pods, and the cache-aware choice
of prefill and decode instance stays where the keys are right: the Conductor's ``Place`` call
the gateway makes with them. What the picker adds at the proxy, from the same Conductor:

- a bad body (not JSON, no model, no messages/prompt/input) is answered at once with 400;
- a request for a model no placeable prefill or decode instance serves is answered at once
  with 503, the Conductor's reason (``no_prefill_instance``/``no_decode_instance``) and
  Retry-After, before a gateway tokenizes it;
- the gateway pod chosen is the one with the fewest requests in flight through this picker
  (an ext_proc stream lasts as long as its HTTP request), so long streams spread out;
- when the proxy names the subset of the pool it may send to (the protocol's
  ``envoy.lb.subset_hint`` filter metadata), the pick is one of those; an empty subset is a 503.

Every decision is counted by outcome (``crescent_endpoint_picker_decisions``) and timed; the
requests still open are a gauge per gateway endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.common.metrics import endpoint_picker_metrics
from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.datatypes import Role

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Inference Extension's protocol
METADATA_NAMESPACE = "envoy.lb"                          # where proxies read it from metadata
SUBSET_NAMESPACE = "envoy.lb.subset_hint"                # where a proxy names the endpoints allowed
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the picker reads from an OpenAI request body."""

    model: str
    max_tokens: int  # 0: not stated


@dataclass(frozen=True, slots=True)
class Pick:
    endpoint: str  # host:port of a gateway pod


@dataclass(frozen=True, slots=True)
class Refusal:
    """An immediate answer instead of a route: HTTP status, a named reason, a message."""

    status: int
    reason: str
    message: str
    retry_after_s: float = 0.0

    def body(self) -> bytes:
        error_type = "invalid_request_error" if self.status < 500 and self.status != 429 else "service_unavailable"
        return json.dumps({"error": {"message": self.message, "type": error_type, "code": self.reason}}).encode()


def bad_request(reason: str, message: str) -> Refusal:
    return Refusal(400, reason, message)


def parse_body(body: bytes) -> RequestFacts | Refusal:
    """The model and length of an OpenAI chat, completions or responses request, or a 400."""
    if len(body) > MAX_BODY_BYTES:
        return Refusal(413, "body_too_large", f"request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return bad_request("invalid_json", f"request body is not JSON: {exc}")
    if not isinstance(data, dict):
        return bad_request("invalid_body", "request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        return bad_request("missing_model", "'model' must be a non-empty string")
    messages, prompt, input_ = data.get("messages"), data.get("prompt"), data.get("input")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            return bad_request("invalid_messages", "'messages' must be a non-empty list")
    elif prompt is not None:
        if not isinstance(prompt, (str, list)) or not prompt:
            return bad_request("invalid_prompt", "'prompt' must be a non-empty string or list")
    elif input_ is None:
        return bad_request("missing_prompt", "the body needs 'messages' (chat), 'prompt' (completions) or 'input' (responses)")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens", data.get("max_output_tokens")))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        return bad_request("invalid_max_tokens", "max_tokens must be a positive integer")
    return RequestFacts(model, max_tokens or 0)


class GatewayEndpoints:
    """The gateway pods, from ``host:port`` targets (comma-separated) whose hosts resolve to each
    of them (in a cluster, one headless Service: its DNS name answers with the ready pods'
    addresses), re-resolved every ``refresh_s``."""

    def __init__(self, targets: str, refresh_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = [_host_port(t.strip()) for t in targets.split(",") if t.strip()]
        if not self.targets:
            raise ValueError("endpoint_picker.gateways names no host:port")
        self.names = ", ".join(host for host, _ in self.targets)
        self.refresh_s = refresh_s
        self._clock = clock
        self._addresses: list[str] = []
        self._resolved_at = -math.inf
        self._lock = asyncio.Lock()

    async def current(self) -> list[str]:
        async with self._lock:
            if self._clock() - self._resolved_at >= self.refresh_s:
                found: set[str] = set()
                for host, port in self.targets:
                    found.update(await _resolve(host, port))
                self._addresses, self._resolved_at = sorted(found), self._clock()
        return self._addresses


def _host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint_picker.gateways: each target must be host:port, got {target!r}")
    return host.strip("[]"), int(port)


async def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.warning("cannot resolve the gateways' name %s: %s", host, exc)
        return []  # an empty pool answers 503 no_gateway_endpoint, naming the host
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in {info[4][0] for info in infos}]


class EndpointPicker:
    """Decides one request: a gateway pod, or an immediate refusal with a named reason."""

    def __init__(self, conductor: Conductor, gateways: GatewayEndpoints) -> None:
        self.conductor = conductor
        self.gateways = gateways
        self.in_flight: dict[str, int] = {}
        self.metrics = endpoint_picker_metrics()

    async def pick(self, headers: Mapping[str, str], body: bytes | None,
                   subset: list[str] | None = None) -> Pick | Refusal:
        """``body`` None: the request has none (e.g. ``GET /v1/models``): any gateway answers it.
        ``subset``: the endpoints the proxy allows (its subset hint), None when it sent none."""
        start = time.perf_counter()
        decision = await self._decide(body, subset)
        self.metrics.pick_seconds.observe(time.perf_counter() - start)
        self.metrics.decisions.labels("routed" if isinstance(decision, Pick) else decision.reason).inc()
        return decision

    async def _decide(self, body: bytes | None, subset: list[str] | None) -> Pick | Refusal:
        if body is not None:
            facts = parse_body(body)
            if isinstance(facts, Refusal):
                return facts
            refusal = self._eligible(facts)
            if refusal is not None:
                return refusal
        retry_after = self.conductor.settings.no_instance_retry_after_s
        if subset is not None:
            if not subset:
                return Refusal(503, "empty_endpoint_subset", "the proxy allowed no endpoint of the pool for this request",
                               retry_after)
            # The proxy's list is authoritative; of its members, prefer those our own lookup of
            # the gateways also sees ready (it may lag the proxy's by a refresh either way).
            known = set(await self.gateways.current())
            endpoints = [e for e in subset if e in known] or subset
        else:
            endpoints = await self.gateways.current()
        if not endpoints:
            return Refusal(503, "no_gateway_endpoint", f"no ready gateway pod behind {self.gateways.names}", retry_after)
        return Pick(min(endpoints, key=lambda e: (self.in_flight.get(e, 0), e)))

    def _eligible(self, facts: RequestFacts) -> Refusal | None:
        """The Conductor's own refusal when nothing could place a request for this model."""
        view = self.conductor.view(facts.model)
        for role, candidates in ((Role.PREFILL, view.prefill), (Role.DECODE, view.decode)):
            if not candidates:
                return Refusal(503, f"no_{role.value}_instance",
                               f"no {role.value} instance is registered and taking requests for model {facts.model!r}",
                               self.conductor.settings.no_instance_retry_after_s)
        return None

    def started(self, endpoint: str) -> None:
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1
        self.metrics.in_flight.labels(endpoint).set(self.in_flight[endpoint])

    def finished(self, endpoint: str) -> None:
        left = self.in_flight.get(endpoint, 0) - 1
        if left > 0:
            self.in_flight[endpoint] = left
        else:
            self.in_flight.pop(endpoint, None)
        self.metrics.in_flight.labels(endpoint).set(max(left, 0))


def subset_hint(metadata: Any) -> list[str] | None:
    """The endpoints a proxy allows for this request, from an ext_proc request's
    ``metadata_context`` (``envoy.config.core.v3.Metadata``); None when it names no subset.
    Entries that are not strings are ignored (the protocol says addresses, ``ip:port``)."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE) if metadata is not None else None
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.WhichOneof("kind") != "list_value":
        return []  # malformed: allows nothing, answered 503 rather than ignored
    return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]


def header_map(raw: Any) -> dict[str, str]:
    """Envoy's HeaderMap as a dict with lower-case names (values come as ``raw_value`` bytes
    from current proxies, as ``value`` from older ones)."""
    out = {}
    for h in raw.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out
