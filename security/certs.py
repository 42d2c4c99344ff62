"""A development CA and per-service certificates for cluster mTLS (``halfmoon certs``), made with
the ``cryptography`` library: ECDSA P-256 keys, SHA-256 signatures.

Layout of ``out``::

    ca.pem  ca-key.pem               the CA (an existing pair in ``out`` is reused, so services can be added)
    <service>.pem  <service>-key.pem  one leaf per service (serverAuth + clientAuth: every service is
                                      both a server and a client of others)

Each leaf's SANs: DNS ``<service>``, ``localhost`` and the DNS names / IPs in ``hosts``, plus IP
127.0.0.1 and ::1. Keys are written 0600. For production use certificates from your own PKI
(cert-manager, Vault); these are for ``halfmoon up --tls`` and tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SERVICES = ("registry", "router", "prefill", "decode", "client")


@dataclass(frozen=True)
class ServiceCert:
    """Paths of one service's certificate and key, and of the CA that signed it."""
    name: str
    cert: Path
    key: Path
    ca: Path

    def flags(self) -> list[str]:
        """The ``--tls-cert/--tls-key/--tls-ca`` argv of a service using this certificate."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "halfmoon"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(common_name: str = "halfmoon dev CA", days: int = 365):
    """A self-signed CA -> (private key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _san(service: str, hosts) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys([service, "localhost", "127.0.0.1", "::1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def issue(ca_key, ca_cert, service: str, hosts=(), days: int = 365):
    """A leaf certificate for ``service`` signed by the CA -> (private key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(service)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(service, hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _load_or_create_ca(out: Path, days: int):
    ca_pem, ca_key_pem = out / "ca.pem", out / "ca-key.pem"
    if ca_pem.exists() and ca_key_pem.exists():
        try:
            return (serialization.load_pem_private_key(ca_key_pem.read_bytes(), password=None),
                    x509.load_pem_x509_certificate(ca_pem.read_bytes()))
        except ValueError as e:
            raise ValueError(f"{out}: ca.pem / ca-key.pem exist but cannot be read ({e})") from None
    key, cert = create_ca(days=days)
    _write(ca_key_pem, _key_pem(key), private=True)
    _write(ca_pem, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return key, cert


def write_dev_certs(out: str | Path, services=DEFAULT_SERVICES, hosts=(), days: int = 365) -> dict[str, ServiceCert]:
    """Create (or reuse) the CA in ``out`` and one certificate per service -> {service: ServiceCert}.

    Raises:
        ValueError: a service name that is not a DNS label-like name, or an unreadable CA in ``out``.
        OSError: ``out`` cannot be created or written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for s in services:
        if not s or not all(c.isalnum() or c in "-." for c in s):
            raise ValueError(f"service name {s!r}: use letters, digits, '-' and '.'")
    ca_key, ca_cert = _load_or_create_ca(out, days)
    made = {}
    for s in services:
        key, cert = issue(ca_key, ca_cert, s, hosts, days)
        _write(out / f"{s}-key.pem", _key_pem(key), private=True)
        _write(out / f"{s}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
        made[s] = ServiceCert(s, out / f"{s}.pem", out / f"{s}-key.pem", out / "ca.pem")
    return made


__all__ = ["DEFAULT_SERVICES", "ServiceCert", "create_ca", "issue", "write_dev_certs"]
