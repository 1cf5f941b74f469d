"""TLS on the wire: how this process listens and dials, and a development certificate set.

One service runs per process, so the credentials are configured once (`configure`, at start)
and every server and channel of the process uses them:
- internal services (scheduler, verifier, drafter) serve mTLS: a caller without a certificate
  signed by the cluster's CA is refused in the handshake, and a call from a service that may
  not make it is refused PERMISSION_DENIED (`Authorizer`: each certificate names its service,
  subject CN `specserve <service>`);
- the gateway serves TLS to the public (no client certificate asked);
- every internal channel presents this service's certificate and checks the peer's against
  the CA, by the name the peer's service's certificate carries (`<service>.<tls_server_name>`:
  a drafter's certificate cannot pass for a scheduler), since dialled addresses are often IPs
  from the registry.
Plaintext needs `insecure: true` (local development only; no identities, nothing refused).
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
SERVICES = ("gateway", "scheduler", "verifier", "drafter")
DEV_NAMES = (*SERVICES, "client")  # client: an operator's tools (doctor, rollout probe)
CN_PREFIX = "specserve "  # a certificate's subject CN: "specserve <service>"


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


def channel(
    address: str, peer: str, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A channel to another service of the cluster (`peer`: which, e.g. "scheduler"), with
    this service's certificate; the peer's must be its service's."""
    options = list(options or [])
    if _creds is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(_creds.ca, _creds.key, _creds.cert)
    options.append(("grpc.ssl_target_name_override", f"{peer}.{_creds.server_name}"))
    return grpc.secure_channel(address, credentials, options=options)


def aio_channel(address: str, peer: str, options: list[tuple[str, object]] | None = None):
    """`channel` for grpc.aio (create it on the event loop that uses it)."""
    options = list(options or [])
    if _creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(_creds.ca, _creds.key, _creds.cert)
    options.append(("grpc.ssl_target_name_override", f"{peer}.{_creds.server_name}"))
    return grpc.aio.secure_channel(address, credentials, options=options)


def caller(context) -> str | None:
    """The service an mTLS call comes from, by its certificate's subject CN; None if none."""
    for name in context.auth_context().get("x509_common_name", []):
        if (text := name.decode(errors="replace")).startswith(CN_PREFIX):
            return text.removeprefix(CN_PREFIX)
    return None


class Authorizer(grpc.ServerInterceptor):
    """Lets a call of an internal server through only from the services `callers` names for
    its method ("/pkg.Service/Method") or its whole service ("/pkg.Service/"); methods of
    neither (health, reflection) are any certificate's of the CA. Under mTLS only: plaintext
    carries no identity."""

    def __init__(self, callers: dict[str, frozenset[str]]):
        self.callers = callers

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        allowed = self.callers.get(method, self.callers.get(method.rsplit("/", 1)[0] + "/"))
        if handler is None or allowed is None:
            return handler

        def guard(behavior):
            def checked(request, context):
                who = caller(context)
                if who not in allowed:
                    context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"{method}: not for the {who or 'unnamed'} certificate (only "
                        f"{', '.join(sorted(allowed))})",
                    )
                return behavior(request, context)

            return checked

        kind = (handler.request_streaming, handler.response_streaming)
        make, behavior = {
            (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
            (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
            (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
            (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
        }[kind]
        return make(
            guard(behavior),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def authorizers(callers: dict[str, frozenset[str]] | None, public: bool) -> list:
    """The interceptors of a server: an Authorizer on an internal port under mTLS."""
    return [Authorizer(callers)] if callers and _creds is not None and not public else []


def make_dev_certs(out: Path, days: int = 365) -> dict[str, Path]:
    """A private CA and, signed by it, a certificate and key per service (and one for an
    operator's client), each naming its own: subject CN `specserve <name>`, valid for
    `<name>.SERVER_NAME` (the gateway's also for localhost and 127.0.0.1, where clients
    reach it), for serving and for calling (a service checks its own health with its own),
    a client's for calling only. Returns the paths."""
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
    for who in DEV_NAMES:
        names: list[x509.GeneralName] = [x509.DNSName(f"{who}.{SERVER_NAME}")]
        if who == "gateway":
            names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        sans = x509.SubjectAlternativeName(names)
        usage = x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH] * (who != "client")
            + [ExtendedKeyUsageOID.CLIENT_AUTH]
        )
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
