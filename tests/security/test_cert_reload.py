"""Certificates renewed under running processes (issue 29, item 6): the files are replaced as
cert-manager replaces a Secret's, and a real scheduler process serves the new certificate and
trusts the new CA without a restart, a client's channel re-opens itself with its new key pair,
and a side channel serves its renewed certificate. Each case fails on code that read the files
once at start-up."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from crescent.services.common.certs import make_pki
from crescent.services.common.grpc_service import open_channel
from crescent.services.common.tls import CHECK_EVERY_S, TlsSettings, load_tls
from crescent.services.kvwire.side_channel import SideChannelServer, SideTls, tls_contexts
from tests.scheduler.support import SchedulerProcess, free_port

SERVER_FILES = ("ca.pem", "scheduler.pem", "scheduler-key.pem")
CLIENT_FILES = ("ca.pem", "gateway.pem", "gateway-key.pem")


def issue(directory: Path) -> Path:
    """A CA of its own in ``directory`` with a scheduler and a gateway certificate."""
    make_pki(directory, [("scheduler", "scheduler"), ("gateway", "gateway")])
    return directory


def install(source: Path, names: tuple[str, ...], target: Path) -> None:
    """Replace ``target``'s files as a Secret volume's are replaced: each written aside, then renamed."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source / name, target / f".{name}.new")
        (target / f".{name}.new").rename(target / name)


def settings(directory: Path, role: str) -> TlsSettings:
    return TlsSettings(ca=str(directory / "ca.pem"), cert=str(directory / f"{role}.pem"),
                       key=str(directory / f"{role}-key.pem"))


@pytest.fixture
def pkis(tmp_path: Path) -> tuple[Path, Path]:
    return issue(tmp_path / "pki-a"), issue(tmp_path / "pki-b")


@pytest.fixture
def scheduler(pkis: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[SchedulerProcess, Path]]:
    files = tmp_path / "scheduler-tls"
    install(pkis[0], SERVER_FILES, files)
    port, admin = free_port(), free_port()
    config = tmp_path / "scheduler.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port, "admin_port": admin},
                                      "tls": settings(files, "scheduler").model_dump()}))
    process = SchedulerProcess(config, port, admin)
    process.start()
    yield process, files
    process.stop()


async def list_instances(address: str, channel: grpc.aio.Channel | None = None, tls_dir: Path | None = None) -> grpc.StatusCode:
    async def go(ch: grpc.aio.Channel) -> grpc.StatusCode:
        try:
            await scheduler_pb2_grpc.SchedulerStub(ch).ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    if channel is not None:
        return await go(channel)
    assert tls_dir is not None
    async with open_channel(address, load_tls(settings(tls_dir, "gateway"))) as fresh:
        return await go(fresh)


@pytest.mark.slow
async def test_a_running_server_serves_its_renewed_certificate_and_trusts_the_new_ca(
        scheduler: tuple[SchedulerProcess, Path], pkis: tuple[Path, Path]) -> None:
    process, files = scheduler
    old, new = pkis
    assert await list_instances(process.address, tls_dir=old) == grpc.StatusCode.OK
    assert await list_instances(process.address, tls_dir=new) == grpc.StatusCode.UNAVAILABLE, "not yet trusted"
    install(new, SERVER_FILES, files)  # the CA rotated: the scheduler's files now come from the new CA
    await asyncio.sleep(CHECK_EVERY_S + 0.3)
    assert await list_instances(process.address, tls_dir=new) == grpc.StatusCode.OK, "served without a restart"
    assert await list_instances(process.address, tls_dir=old) == grpc.StatusCode.UNAVAILABLE, "the old CA is gone"


@pytest.mark.slow
async def test_a_client_channel_reopens_with_its_renewed_key_pair(
        scheduler: tuple[SchedulerProcess, Path], pkis: tuple[Path, Path], tmp_path: Path) -> None:
    """The channel outlives its certificate: after the rotation the scheduler restarts (every
    connection is new) and trusts only the new CA; a channel that kept its first key pair would
    fail every call from then on."""
    process, server_files = scheduler
    old, new = pkis
    client_files = tmp_path / "gateway-tls"
    install(old, CLIENT_FILES, client_files)
    async with open_channel(process.address, load_tls(settings(client_files, "gateway"))) as channel:
        assert await list_instances(process.address, channel) == grpc.StatusCode.OK
        install(new, CLIENT_FILES, client_files)
        install(new, SERVER_FILES, server_files)
        process.stop()
        process.start()
        deadline = time.monotonic() + 10
        status = await list_instances(process.address, channel)
        while status != grpc.StatusCode.OK and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            status = await list_instances(process.address, channel)
        assert status == grpc.StatusCode.OK


def test_a_half_written_renewal_keeps_the_previous_pair(pkis: tuple[Path, Path], tmp_path: Path) -> None:
    old, new = pkis
    files = tmp_path / "tls"
    install(old, CLIENT_FILES, files)
    tls = load_tls(settings(files, "gateway"))
    assert tls is not None
    shutil.copyfile(new / "gateway.pem", files / "gateway.pem")  # the certificate, not yet its key
    time.sleep(CHECK_EVERY_S + 0.1)
    assert tls.latest().cert == (old / "gateway.pem").read_bytes(), "a mismatched pair is not taken"
    shutil.copyfile(new / "gateway-key.pem", files / "gateway-key.pem")
    time.sleep(CHECK_EVERY_S + 0.1)
    assert tls.latest().cert == (new / "gateway.pem").read_bytes()


def _handshake(address: tuple[str, int], context: ssl.SSLContext) -> bool:
    """Whether a TLS handshake with the side channel at ``address`` completes."""
    try:
        with context.wrap_socket(socket.create_connection(address, timeout=5), server_hostname="localhost"):
            return True
    except (ssl.SSLError, OSError):
        return False


def test_the_side_channel_serves_its_renewed_certificate(pkis: tuple[Path, Path], tmp_path: Path) -> None:
    old, new = pkis
    files = tmp_path / "side-tls"
    install(old, SERVER_FILES, files)
    tls = load_tls(settings(files, "scheduler"))
    assert tls is not None
    server = SideChannelServer("127.0.0.1", server_tls=SideTls(tls))
    address = ("127.0.0.1", server.port)
    try:
        new_client = tls_contexts(load_tls(settings(new, "gateway")))[1]
        assert _handshake(address, tls_contexts(load_tls(settings(old, "gateway")))[1])
        assert not _handshake(address, new_client), "the new CA is not trusted yet"
        install(new, SERVER_FILES, files)
        time.sleep(CHECK_EVERY_S + 0.1)
        assert _handshake(address, new_client), "renewed without a restart"
    finally:
        server.close()
