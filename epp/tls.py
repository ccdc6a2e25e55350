"""TLS for the ext_proc port, the way GAIE's endpoint picker serves it (docs/epp.md "TLS").

- `TlsSettings(cert_path, reload)`: what `--secure-serving`, `--cert-path` and
  `--enable-cert-reload` ask for. No `cert_path`: a self-signed certificate made at start.
- `KeyPair`: PEM certificate chain + private key; `load_key_pair(folder)` reads `tls.crt` and
  `tls.key` (the file names of a Kubernetes TLS Secret) and checks that they belong together;
  `self_signed_pair()` makes one with `cryptography`.
- `server_credentials(settings) -> (grpc.ServerCredentials, CertificateSource)`: static
  credentials, or with `reload` dynamic ones whose fetcher gRPC calls before every new
  connection's handshake; the fetcher re-reads the folder only when a file's identity (inode,
  size, mtime) changed, and keeps serving the last good pair when the new files are broken or
  half-written (a Secret volume swaps its `..data` symlink atomically; cert-manager rotates).

Every problem with the files is a `TlsError` whose message names the file and what is wrong.
"""

import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
# GAIE's EPP signs its self-signed certificate for 10 years with organisation "Inference Ext".
SELF_SIGNED_VALIDITY = datetime.timedelta(days=3650)
SELF_SIGNED_ORGANIZATION = "dynamograph endpoint picker"


class TlsError(ValueError):
    """A certificate or key that cannot be served; the message says which file and why."""


@dataclass(frozen=True)
class TlsSettings:
    cert_path: Path | None = None  # folder with tls.crt + tls.key; None: self-signed
    reload: bool = False  # re-read cert_path when its files change


@dataclass(frozen=True)
class KeyPair:
    certificate_chain: bytes  # PEM, leaf first
    private_key: bytes  # PEM

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.certificate_chain)


def self_signed_pair(hosts: tuple[str, ...] | None = None) -> KeyPair:
    """A fresh ECDSA P-256 key and a certificate for `hosts` (default: this host's name,
    localhost, 127.0.0.1, ::1 and $POD_IP), signed by itself, valid 10 years.

    Gateways connect to a self-signed EPP without verifying it (Istio `insecureSkipVerify`,
    kgateway's empty validation context), so the names only matter to a client that pins it.
    """
    hosts = hosts or _default_hosts()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, SELF_SIGNED_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64]),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew
        .not_valid_after(now + SELF_SIGNED_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def _default_hosts() -> tuple[str, ...]:
    hosts = [socket.gethostname() or "localhost", "localhost", "127.0.0.1", "::1"]
    pod_ip = os.environ.get("POD_IP")
    if pod_ip:
        hosts.append(pod_ip)
    return tuple(dict.fromkeys(h for h in hosts if h))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{path}: no such file (a TLS Secret mounts tls.crt and tls.key)") from None
    except IsADirectoryError:
        raise TlsError(f"{path}: is a directory, expected a PEM file") from None
    except OSError as exc:
        raise TlsError(f"{path}: cannot read: {exc.strerror}") from None


def load_key_pair(folder: Path) -> KeyPair:
    """`folder/tls.crt` + `folder/tls.key`, checked: both PEM, the key is the certificate's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TlsError(f"--cert-path {folder}: not a directory")
    cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
    chain, key_pem = _read(cert_path), _read(key_path)
    try:
        certificate = x509.load_pem_x509_certificate(chain)
    except ValueError:
        raise TlsError(f"{cert_path}: not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TlsError(f"{key_path}: the private key is encrypted; give it unencrypted") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsError(f"{key_path}: not a PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if key.public_key().public_bytes(encoding, public) != certificate.public_key().public_bytes(
        encoding, public
    ):
        raise TlsError(
            f"{key_path} does not belong to {cert_path} (subject "
            f"{certificate.subject.rfc4514_string()!r}): the key pair does not match"
        )
    return KeyPair(chain, key_pem)


def _identity(folder: Path) -> tuple:
    """What changes when either file is replaced (os.stat follows the Secret's symlinks)."""
    out: list[tuple[int, int, int] | None] = []
    for name in (CERT_FILE, KEY_FILE):
        try:
            st = os.stat(folder / name)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class CertificateSource:
    """The pair being served, and (with reload) the fetcher gRPC calls per new connection."""

    def __init__(self, settings: TlsSettings):
        self.settings = settings
        self._lock = threading.Lock()  # gRPC may call the fetcher from several core threads
        if settings.cert_path is None:
            self.pair = self_signed_pair()
            self._seen: tuple | None = None
        else:
            self._seen = _identity(settings.cert_path)
            self.pair = load_key_pair(settings.cert_path)
        self.reloads = 0  # how many times a changed pair was taken up

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed and load cleanly, else None (keep)."""
        folder = self.settings.cert_path
        assert folder is not None
        with self._lock:
            seen = _identity(folder)
            if seen == self._seen:
                return None
            self._seen = seen  # try each new state of the files once; log a failure once
            try:
                pair = load_key_pair(folder)
            except TlsError as exc:
                log.error("TLS key pair not reloaded, still serving the previous one: %s", exc)
                return None
            if pair == self.pair:
                return None
            self.pair = pair
            self.reloads += 1
        log.info(
            "TLS certificate reloaded",
            extra={"subject": pair.certificate.subject.rfc4514_string(), "folder": str(folder)},
        )
        return _configuration(pair)


def _configuration(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.private_key, pair.certificate_chain)])


def server_credentials(settings: TlsSettings) -> tuple[grpc.ServerCredentials, CertificateSource]:
    """Credentials for the ext_proc port; TlsError when the files cannot be served."""
    source = CertificateSource(settings)
    if settings.reload and settings.cert_path is not None:
        credentials = grpc.dynamic_ssl_server_credentials(
            _configuration(source.pair),
            source.fetch,  # type: ignore[arg-type]  # None means "unchanged"; grpc's stubs omit it
            require_client_authentication=False,
        )
    else:
        credentials = grpc.ssl_server_credentials(
            [(source.pair.private_key, source.pair.certificate_chain)]
        )
    return credentials, source
