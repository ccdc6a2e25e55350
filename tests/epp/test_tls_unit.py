"""TLS for the ext_proc port without a server: the key-pair checks and their messages, the
self-signed certificate, the reload source's change detection, and the flags' combinations."""

import argparse

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dynamograph.epp.cli import add_arguments, settings_from_args, tls_from_args
from dynamograph.epp.tls import (
    CertificateSource,
    KeyPair,
    TlsError,
    TlsSettings,
    load_key_pair,
    self_signed_pair,
)

from .conftest import SecretVolume

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def pairs() -> tuple[KeyPair, KeyPair]:
    return self_signed_pair(("localhost",)), self_signed_pair(("localhost",))


def test_self_signed_certificate_names_the_hosts_and_is_a_server_certificate():
    pair = self_signed_pair(("epp.serving.svc", "10.1.2.3"))
    cert = pair.certificate
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["epp.serving.svc"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert cert.issuer == cert.subject
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days >= 3650
    assert self_signed_pair(("localhost",)) != self_signed_pair(("localhost",))  # fresh keys


def test_default_self_signed_hosts_include_loopback_and_pod_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.9.8.7")
    names = self_signed_pair().certificate.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    ips = {str(ip) for ip in names.value.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "::1", "10.9.8.7"} <= ips
    assert "localhost" in names.value.get_values_for_type(x509.DNSName)


def test_a_secret_folder_loads(tmp_path, pairs):
    volume = SecretVolume(tmp_path / "tls")
    volume.publish(pairs[0])
    assert load_key_pair(volume.root) == pairs[0]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d, a, b: None, "not a directory"),
        (lambda d, a, b: _write(d, a.certificate_chain, None), r"tls\.key: no such file"),
        (lambda d, a, b: _write(d, b"junk", a.private_key), r"tls\.crt: not a PEM certificate"),
        (lambda d, a, b: _write(d, a.certificate_chain, b"junk"), r"tls\.key: not a PEM private"),
        (
            lambda d, a, b: _write(d, a.certificate_chain, b.private_key),
            r"tls\.key does not belong to .*tls\.crt .*key pair does not match",
        ),
        (
            lambda d, a, b: _write(d, a.certificate_chain, _encrypted(a)),
            "encrypted; give it unencrypted",
        ),
    ],
    ids=["no-folder", "no-key", "bad-cert", "bad-key", "mismatch", "encrypted"],
)
def test_key_pair_problems_are_clear_errors(tmp_path, pairs, setup, message):
    folder = tmp_path / "tls"
    setup(folder, *pairs)
    with pytest.raises(TlsError, match=message):
        load_key_pair(folder)
    # The CLI refuses to start with the same message (exit 2), before binding anything.
    with pytest.raises(ValueError, match=message):
        settings_from_args(_parse("--cert-path", str(folder)))


def test_unreadable_file_is_a_clear_error(tmp_path, pairs):
    folder = tmp_path / "tls"
    _write(folder, pairs[0].certificate_chain, pairs[0].private_key)
    (folder / "tls.key").unlink()
    (folder / "tls.key").mkdir()
    with pytest.raises(TlsError, match=r"tls\.key: is a directory"):
        load_key_pair(folder)


def _write(folder, cert: bytes | None, key: bytes | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if cert is not None:
        (folder / "tls.crt").write_bytes(cert)
    if key is not None:
        (folder / "tls.key").write_bytes(key)


def _encrypted(pair: KeyPair) -> bytes:
    key = serialization.load_pem_private_key(pair.private_key, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )


def test_reload_source_takes_up_changes_once_and_keeps_the_last_good_pair(tmp_path, pairs):
    first, second = pairs
    volume = SecretVolume(tmp_path / "tls")
    volume.publish(first)
    source = CertificateSource(TlsSettings(volume.root, reload=True))
    assert source.pair == first
    assert source.fetch() is None  # unchanged: gRPC keeps its configuration
    volume.publish(second)
    assert source.fetch() is not None and source.pair == second and source.reloads == 1
    assert source.fetch() is None
    # A broken rotation (key of another certificate) is refused; the good pair stays.
    volume.publish(KeyPair(first.certificate_chain, second.private_key))
    assert source.fetch() is None and source.pair == second
    volume.publish(first)
    assert source.fetch() is not None and source.pair == first and source.reloads == 2


def test_flags_choose_plaintext_self_signed_or_a_folder(tmp_path, pairs, monkeypatch):
    assert tls_from_args(_parse()) is None  # plaintext unless asked (GAIE: TLS by default)
    assert tls_from_args(_parse("--secure-serving")) == TlsSettings()
    assert tls_from_args(_parse("--secure-serving=true")) == TlsSettings()
    assert tls_from_args(_parse("--secure-serving=false")) is None
    folder = tmp_path / "tls"
    _write(folder, pairs[0].certificate_chain, pairs[0].private_key)
    # GAIE's flags as its chart writes them; --cert-path alone implies secure serving.
    for argv in (
        ("--secure-serving", "--cert-path", str(folder), "--enable-cert-reload"),
        ("--cert-path", str(folder), "--enable-cert-reload=true"),
    ):
        assert tls_from_args(_parse(*argv)) == TlsSettings(folder, reload=True)
    assert tls_from_args(_parse("--cert-path", str(folder))) == TlsSettings(folder)
    monkeypatch.setenv("DYNAMOGRAPH_EPP_SECURE_SERVING", "true")
    assert tls_from_args(_parse()) == TlsSettings()
    assert tls_from_args(_parse("--secure-serving", "false")) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--secure-serving=false", "--cert-path", "x"), "--cert-path needs secure serving"),
        (("--enable-cert-reload",), "--enable-cert-reload needs --cert-path"),
        (("--secure-serving", "--enable-cert-reload"), "self-signed certificate is not reloaded"),
    ],
)
def test_meaningless_flag_combinations_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        tls_from_args(_parse(*argv))


def test_bad_boolean_is_an_argparse_error(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        _parse("--secure-serving=maybe")
    assert "expected true or false, not 'maybe'" in capsys.readouterr().err
    monkeypatch.setenv("DYNAMOGRAPH_EPP_CERT_RELOAD", "sometimes")
    with pytest.raises(SystemExit):
        _parse()
    assert "expected true or false, not 'sometimes'" in capsys.readouterr().err
