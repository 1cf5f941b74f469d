"""TLS on the wire: how this process listens and dials, and a development certificate set.

One service runs per process, so the credentials are configured once (`configure`, at start)
and every server and channel of the process uses them:
- internal services (scheduler, verifier, drafter) serve mTLS: a caller without a certificate
  signed by the cluster's CA is refused in the handshake;
- the gateway serves TLS to the public (no client certificate asked);
- every internal channel presents this service's certificate and checks the peer's against
  the CA, by the name the certificates carry (`tls_server_name`), since dialled addresses are
  often IPs from the registry.
Plaintext needs `insecure: true` (local development only).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from .settings import ConfigError, ServiceSettings

log = logging.getLogger(__name__)

SERVER_NAME = "specserve.internal"
DEV_NAMES = ("gateway", "scheduler", "verifier", "drafter", "client")


@dataclass(frozen=True)
class Credentials:
    ca: bytes
    cert: bytes
    key: bytes
    server_name: str
    cert_file: str  # (the HTTP server's ssl module loads the pair from files)
    key_file: str


_creds: Credentials | None = None  # None: plaintext


def configure(settings: ServiceSettings) -> None:
    """Reads this process's certificate, key and CA; ConfigError naming what is missing."""
    global _creds
    if settings.insecure:
        log.warning("plaintext gRPC (insecure: true): for local development only")
        _creds = None
        return
    files = {
        "tls_ca_file": settings.tls_ca_file,
        "tls_cert_file": settings.tls_cert_file,
        "tls_key_file": settings.tls_key_file,
    }
    missing = [name for name, path in files.items() if not path]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: needed for TLS (`specserve certs dev --out DIR` makes a "
            "development set), or set insecure: true for plaintext local development"
        )
    try:
        ca, cert, key = (Path(path).read_bytes() for path in files.values())
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename}: {e.strerror}") from None
    _creds = Credentials(
        ca, cert, key, settings.tls_server_name, settings.tls_cert_file, settings.tls_key_file
    )


def add_port(server: grpc.Server, address: str, public: bool) -> int:
    """Listens on `address`: mTLS (TLS without client certificates when `public`), or
    plaintext when insecure."""
    if _creds is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(_creds.key, _creds.cert)],
        root_certificates=None if public else _creds.ca,
        require_client_auth=not public,
    )
    return server.add_secure_port(address, credentials)


def http_context() -> ssl.SSLContext | None:
    """TLS for the gateway's public HTTP port, as `add_port` serves the public gRPC port (no
    client certificate asked); None when insecure."""
    if _creds is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(_creds.cert_file, _creds.key_file)
    return context


def channel(address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A channel to another service of the cluster, with this service's certificate."""
    options = list(options or [])
    if _creds is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(_creds.ca, _creds.key, _creds.cert)
    options.append(("grpc.ssl_target_name_override", _creds.server_name))
    return grpc.secure_channel(address, credentials, options=options)


def aio_channel(address: str, options: list[tuple[str, object]] | None = None):
    """`channel` for grpc.aio (create it on the event loop that uses it)."""
    options = list(options or [])
    if _creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(_creds.ca, _creds.key, _creds.cert)
    options.append(("grpc.ssl_target_name_override", _creds.server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)


def make_dev_certs(out: Path, days: int = 365) -> dict[str, Path]:
    """A private CA and, signed by it, a certificate and key per service (and one for a
    client), each valid for SERVER_NAME, localhost and 127.0.0.1. Returns the paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("specserve dev CA"))
        .issuer_name(name("specserve dev CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": out / "ca.pem"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_key(ca_key, out / "ca-key.pem")
    sans = x509.SubjectAlternativeName(
        [
            x509.DNSName(SERVER_NAME),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    )
    usage = x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    for who in DEV_NAMES:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(f"specserve {who}"))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(sans, critical=False)
            .add_extension(usage, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        paths[who] = out / f"{who}.pem"
        paths[who].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}-key"] = out / f"{who}-key.pem"
        write_key(key, paths[f"{who}-key"])
    return paths


def dev_tls_config(paths: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Config sections that give each service its certificate from `make_dev_certs`."""
    sections: dict[str, dict[str, str]] = {"common": {"tls_ca_file": str(paths["ca"])}}
    for who in DEV_NAMES[:4]:
        sections[who] = {
            "tls_cert_file": str(paths[who]),
            "tls_key_file": str(paths[f"{who}-key"]),
        }
    return sections
