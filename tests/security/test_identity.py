"""Which role a certificate names: its spiffe://crescent/ URI SAN, or, only when it has none, a
subject CN that is itself such an id (what the chart's self-signed leaves carry, since Helm's
genSignedCert cannot write a URI SAN). A plain CN names no role."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crescent.services.common.access import Peer, identity_of_cert
from crescent.services.common.certs import CertificateAuthority


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create()


def _cert(ca: CertificateAuthority, common_names: list[str], uris: list[str] = (), dns: list[str] = ()) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in common_names]))
               .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)))
    sans = [x509.UniformResourceIdentifier(u) for u in uris] + [x509.DNSName(d) for d in dns]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_the_uri_san_names_the_role_and_instance(ca: CertificateAuthority) -> None:
    pem, _ = ca.issue("prefill", "prefill-0")
    assert identity_of_cert(pem) == Peer("prefill", "prefill-0")


def test_without_a_spiffe_uri_a_cn_that_is_a_spiffe_id_names_the_role(ca: CertificateAuthority) -> None:
    # What the chart's self-signed gateway certificate looks like: DNS names, the id in the CN.
    pem = _cert(ca, ["spiffe://crescent/gateway"], dns=["crescent-internal", "crescent-gateway"])
    assert identity_of_cert(pem) == Peer("gateway", "")
    assert identity_of_cert(_cert(ca, ["spiffe://crescent/kvstore"])) == Peer("kvstore", "")


@pytest.mark.parametrize("common_name", ["gateway", "admin", "crescent/gateway", "spiffe://crescent/",
                                         "spiffe://other/gateway", " spiffe://crescent/gateway",
                                         "https://crescent/gateway"])
def test_a_cn_that_is_not_a_crescent_spiffe_id_names_no_role(ca: CertificateAuthority, common_name: str) -> None:
    assert identity_of_cert(_cert(ca, [common_name], dns=["crescent-internal"])) is None
    assert identity_of_cert(_cert(ca, [common_name])) is None


def test_the_uri_san_wins_over_the_cn(ca: CertificateAuthority) -> None:
    pem = _cert(ca, ["spiffe://crescent/admin"], uris=["spiffe://crescent/gateway"])
    assert identity_of_cert(pem) == Peer("gateway", "")
    # A spiffe URI that names no role is not replaced by the CN's.
    assert identity_of_cert(_cert(ca, ["spiffe://crescent/admin"], uris=["spiffe://crescent/"])) is None


def test_a_non_spiffe_uri_leaves_the_cn_to_name_the_role(ca: CertificateAuthority) -> None:
    pem = _cert(ca, ["spiffe://crescent/scheduler"], uris=["https://example.com/scheduler"])
    assert identity_of_cert(pem) == Peer("scheduler", "")


def test_two_cns_name_no_role(ca: CertificateAuthority) -> None:
    assert identity_of_cert(_cert(ca, ["spiffe://crescent/gateway", "spiffe://crescent/admin"])) is None
