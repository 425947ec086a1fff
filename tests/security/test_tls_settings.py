"""TLS settings, the non-loopback rule, the access table's coverage and ``crescent up``'s PKI."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import yaml

from crescent.services.common.access import rule_for, rules_table
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.settings import ListenSettings, SettingsError, load_settings
from crescent.services.common.tls import TlsError, TlsSettings, check_listen, is_loopback
from crescent.services.kvstore.config import load_kvstore_settings
from crescent.services.launcher import GATEWAY_TLS_ENV, PlanError, Platform, PlatformPlan, admin_tls
from tests.ports import free_port
from tests.security.support import all_methods, full_name


async def _nothing(server) -> None:
    return None


def test_every_method_in_the_protos_has_a_rule_and_every_rule_a_method() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2

    # Crescent's services, and Envoy's ext_proc that the scheduler's endpoint picker serves.
    ext_proc = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    names = {full_name(m) for m in all_methods()} | {full_name(m) for m in ext_proc.methods}
    assert sorted(n for n in names if rule_for(n) is None) == []
    ruled = {f"/{service}/{method}" for service, rules in rules_table().items() for method in rules}
    assert ruled == names


def test_tls_needs_all_three_files_and_names_the_missing_ones(tmp_path: Path) -> None:
    config = tmp_path / "kv.yaml"
    config.write_text(yaml.safe_dump({"tls": {"ca": "/x/ca.pem", "cert": "/x/kv.pem"}}))
    with pytest.raises(SettingsError, match="tls.key"):
        load_kvstore_settings(config)
    settings = load_settings(TlsSettings, env_prefix="T", environ={"T__CA": "a", "T__CERT": "b", "T__KEY": "c"})
    assert settings.enabled


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                                ("localhost", True), ("0.0.0.0", False), ("::", False),
                                                ("10.0.0.5", False), ("node-1.internal", False)])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) == loopback


def test_plaintext_on_a_non_loopback_address_is_refused_with_the_reason() -> None:
    with pytest.raises(TlsError) as refused:
        check_listen("kvstore", "0.0.0.0", TlsSettings())
    message = str(refused.value)
    assert "listen.host" in message and "tls.ca" in message and "allow_plaintext_non_loopback" in message
    check_listen("kvstore", "0.0.0.0", TlsSettings(allow_plaintext_non_loopback=True))  # the override
    check_listen("kvstore", "0.0.0.0", TlsSettings(ca="ca", cert="c", key="k"))          # mutual TLS
    check_listen("kvstore", "127.0.0.1", TlsSettings())                                   # loopback


def test_a_service_refuses_to_start_plaintext_on_all_interfaces() -> None:
    with pytest.raises(TlsError, match="refusing to serve plaintext"):
        GrpcService("scheduler", ListenSettings(host="0.0.0.0"), _nothing)


def test_missing_certificate_files_are_named(tmp_path: Path) -> None:
    tls = TlsSettings(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"))
    with pytest.raises(TlsError, match="tls.ca: cannot read"):
        GrpcService("scheduler", ListenSettings(), _nothing, tls=tls)


def test_crescent_up_gives_every_process_its_own_certificate(tmp_path: Path) -> None:
    platform = Platform(PlatformPlan("m", "127.0.0.1", free_port(), 2, 1, 256, 1 << 20, 16), tmp_path)
    certs = {}
    for spec in platform.specs:
        if spec.service == "gateway":
            files = {k.removeprefix(f"{GATEWAY_TLS_ENV}__").lower(): v for k, v in spec.env.items()}
        else:
            files = spec.config["tls"]
        assert set(files) == {"ca", "cert", "key"}
        assert Path(files["key"]).stat().st_mode & 0o777 == 0o600
        certs[spec.name] = Path(files["cert"]).read_bytes()
    assert len(set(certs.values())) == len(platform.specs) == 6
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    assert admin_tls(tmp_path) is not None
    assert not (tmp_path / "tls" / "ca-key.pem").exists(), "no service can mint a certificate"
    platform.stop(grace_s=0)
    assert not list((tmp_path / "tls").glob("*-key.pem")), "the run's private keys do not outlive it"


def test_crescent_up_without_tls_runs_plaintext(tmp_path: Path) -> None:
    platform = Platform(PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False), tmp_path)
    assert all("tls" not in spec.config and not any(GATEWAY_TLS_ENV in k for k in spec.env) for spec in platform.specs)
    assert admin_tls(tmp_path) is None


def test_the_table_in_docs_security_md_is_the_access_table() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    documented = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in ("Scheduler", "KvStore", "Prefill", "Decode", "ExternalProcessor"):
            roles = cells[2].replace(" (as itself)", "")
            documented[(cells[0], cells[1])] = (frozenset(r.strip() for r in roles.split(",")),
                                                "(as itself)" in cells[2])
    actual = {(service.rsplit(".", 1)[-1], method): (rule.roles, rule.claim is not None)
              for service, rules in rules_table().items() for method, rule in rules.items()}
    assert documented == actual


def test_crescent_up_on_a_network_address_serves_keyless_only_when_told(tmp_path: Path) -> None:
    """crescent up runs the gateway with auth off: on a host others reach, it says so before
    anything starts, unless --allow-unauthenticated-network says the network is trusted."""
    with pytest.raises(PlanError, match="--allow-unauthenticated-network"):
        PlatformPlan("m", "0.0.0.0", free_port(), 1, 1, 256, 1 << 20, 16)
    platform = Platform(PlatformPlan("m", "0.0.0.0", free_port(), 1, 1, 256, 1 << 20, 16, tls=False,
                                     unauthenticated_network=True), tmp_path)
    gateway = next(spec for spec in platform.specs if spec.service == "gateway")
    assert gateway.config["auth"] == {"allow_unauthenticated_network": True}
    local = Platform(PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False), tmp_path / "local")
    assert "auth" not in next(spec for spec in local.specs if spec.service == "gateway").config


def test_crescent_up_keeps_health_and_metrics_on_loopback_whatever_the_host() -> None:
    """Finding 1: ``crescent up --host 0.0.0.0`` exposed every service's /metrics. Their admin ports
    now listen on 127.0.0.1 (the gateway's /metrics leaves tenant data out without the admin key)."""
    plan = PlatformPlan("m", "0.0.0.0", free_port(), 1, 1, 256, 1 << 20, 16, unauthenticated_network=True)
    for spec in plan.services():
        if spec.service == "gateway":
            continue
        assert spec.config["listen"]["host"] == "0.0.0.0"
        assert spec.config["listen"]["admin_host"] == "127.0.0.1", spec.name
        assert spec.health_url.startswith("http://127.0.0.1:") and spec.metrics_url.startswith("http://127.0.0.1:")


def _outbound_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing); None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if is_loopback(address) else address


async def test_a_service_serves_its_admin_port_where_admin_host_says() -> None:
    """gRPC on every interface, /health and /metrics on loopback only: another address of this
    machine is refused."""
    other = _outbound_address()
    service = GrpcService("scheduler", ListenSettings(host="0.0.0.0", admin_host="127.0.0.1"), _nothing,
                          tls=TlsSettings(allow_plaintext_non_loopback=True))
    await service.start()
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"http://127.0.0.1:{service.admin_port}/health")).status_code == 200
            if other is None:
                pytest.skip("this machine has no address but loopback")
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://{other}:{service.admin_port}/metrics")
    finally:
        await service.stop()
