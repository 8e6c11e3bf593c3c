"""The relay's certificate mode (:class:`relay.tlsconfig.RelayTls`): reloading the files
(SIGHUP) keeps serving the old certificate when the new pair is broken, and switches
the fingerprint when it is good. Handshakes run in memory, without sockets."""

from __future__ import annotations

import hashlib
import ssl
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from relay_helpers import memory_handshake, self_signed_pem

from p2pdist.identity import SecretKey
from relay.config import ConfigError
from relay.tlsconfig import RelayTls

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _fingerprint(pem: bytes) -> bytes:
    der = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).digest()


def served_certificate(server: ssl.SSLContext) -> bytes:
    """The SHA-256 of the certificate a client sees in a handshake with ``server`` (an
    in-memory handshake; ssl.SSLError when it fails)."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    c = memory_handshake(client, server, hostname="relay.test")
    der = c.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).digest()


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "live.key"
    key.touch(mode=0o600)
    key.chmod(0o600)  # a private key file, as certbot writes it (the umask aside)
    return tmp_path / "live.crt", key


def test_a_failed_reload_keeps_the_old_certificate_serving(files: tuple[Path, Path]) -> None:
    (a_crt, a_key), (b_crt, _b_key) = self_signed_pem("a"), self_signed_pem("b")
    crt, key = files
    crt.write_bytes(a_crt)
    key.write_bytes(a_key)
    tls = RelayTls.from_files(crt, key)
    assert tls.fingerprint == _fingerprint(a_crt) == served_certificate(tls.context)
    crt.write_bytes(b_crt)  # a renewal half done: the new certificate, the old key
    assert tls.reload() is False
    assert tls.fingerprint == _fingerprint(a_crt) and tls.previous == ()
    assert served_certificate(tls.context) == _fingerprint(a_crt)
    key.unlink()  # an unreadable key is no different
    assert tls.reload() is False
    assert served_certificate(tls.context) == _fingerprint(a_crt)


@pytest.mark.parametrize(
    ("valid_days", "event", "said"),
    [
        ((-90, -1), "certificate_expired", "expired at"),
        ((1, 90), "certificate_not_yet_valid", "is valid from"),
    ],
)
def test_a_reload_refuses_a_certificate_clients_would_refuse(
    files: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
    valid_days: tuple[float, float],
    event: str,
    said: str,
) -> None:
    """A renewal that put an expired (or not yet valid) certificate in place was loaded
    and served, and every client refused the relay (an operator's trial). A reload now
    refuses it and keeps the certificate in use; at start it is logged. Once the good
    files are back, a reload says so."""
    caplog.set_level("INFO", logger="relay")
    tls, (a_crt, a_key), _ = _serving_a(files)
    crt, key = files
    bad_crt, bad_key = self_signed_pem("bad", valid_days=valid_days)
    crt.write_bytes(bad_crt)
    key.write_bytes(bad_key)
    assert tls.reload() is False
    assert served_certificate(tls.context) == _fingerprint(a_crt) == tls.fingerprint
    failed = [
        r.getMessage() for r in caplog.records if "certificate_reload_failed" in r.getMessage()
    ]
    assert len(failed) == 1 and said in failed[0] and "clients would refuse it" in failed[0]
    assert RelayTls.from_files(crt, key).fingerprint == _fingerprint(bad_crt)  # at start: served,
    assert event in caplog.text  # and logged
    crt.write_bytes(a_crt)
    key.write_bytes(a_key)
    assert tls.reload() is False and "certificate_unchanged" in caplog.text


def test_a_certificate_refused_as_not_yet_valid_is_taken_once_it_is(
    files: tuple[Path, Path],
) -> None:
    """A renewal a little ahead of the relay's clock is refused, and read again once it
    is valid, though its files did not change (a reviewer: it was never retried, and
    the old certificate served on until a SIGHUP)."""
    tls, (a_crt, _a_key), _ = _serving_a(files)
    crt, key = files
    soon_crt, soon_key = self_signed_pem("soon", valid_days=(2.0 / 86400, 90))  # in 2 s
    crt.write_bytes(soon_crt)
    key.write_bytes(soon_key)
    assert tls.files_changed() and tls.reload() is False
    assert tls.fingerprint == _fingerprint(a_crt) and not tls.files_changed()
    deadline = time.monotonic() + 10
    while not tls.files_changed():
        assert time.monotonic() < deadline, "never read again"
        time.sleep(0.1)
    assert tls.reload() is True and tls.fingerprint == _fingerprint(soon_crt)
    assert not tls.files_changed()


def _serving_a(
    files: tuple[Path, Path],
) -> tuple[RelayTls, tuple[bytes, bytes], tuple[bytes, bytes]]:
    """Certificate "a" loaded from ``files``, and the PEM pairs of "a" and "b"."""
    a, b = self_signed_pem("a"), self_signed_pem("b")
    crt, key = files
    crt.write_bytes(a[0])
    key.write_bytes(a[1])
    return RelayTls.from_files(crt, key), a, b


def test_a_good_reload_switches_the_certificate_and_the_fingerprint(
    files: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="relay")
    tls, (a_crt, _a_key), (b_crt, b_key) = _serving_a(files)
    crt, key = files
    assert tls.reload() is False  # unchanged files: nothing to do, nothing said
    assert "certificate_unchanged" not in caplog.text  # (a SIGHUP for the allowlist)
    crt.write_bytes(b_crt)
    key.write_bytes(b_key)
    assert tls.reload() is True
    assert tls.fingerprint == _fingerprint(b_crt) == served_certificate(tls.context)
    assert tls.fingerprints == (_fingerprint(b_crt), _fingerprint(a_crt))


def test_changed_files_are_noticed_by_stat_until_read_again(files: tuple[Path, Path]) -> None:
    tls, (_a_crt, _a_key), (b_crt, b_key) = _serving_a(files)
    crt, key = files
    assert not tls.files_changed()
    crt.write_bytes(b_crt)  # half a renewal: noticed, refused, not retried until...
    assert tls.files_changed() and tls.reload() is False and not tls.files_changed()
    key.write_bytes(b_key)  # ...the key follows
    assert tls.files_changed() and tls.reload() is True and not tls.files_changed()
    assert tls.fingerprint == _fingerprint(b_crt)
    assert not RelayTls.pinned(SecretKey.generate()).files_changed()


def test_a_chmod_that_fixes_the_key_and_a_new_chain_for_the_same_leaf_are_taken_up(
    files: tuple[Path, Path],
) -> None:
    tls, (a_crt, _a_key), (b_crt, b_key) = _serving_a(files)
    crt, key = files
    key.write_bytes(b_key)
    key.chmod(0o644)  # a renewal that opened the key up: refused...
    crt.write_bytes(b_crt)
    assert tls.files_changed() and tls.reload() is False and not tls.files_changed()
    key.chmod(0o600)  # ...and the fix alone (no new bytes) is noticed
    assert tls.files_changed() and tls.reload() is True
    serving = tls._serving
    crt.write_bytes(b_crt + a_crt)  # the same leaf with another chain behind it
    assert tls.files_changed() and tls.reload() is False  # the fingerprint stays...
    assert tls._serving is not serving and tls.fingerprint == _fingerprint(b_crt)  # ...served
    assert served_certificate(tls.context) == _fingerprint(b_crt)


def test_a_mismatched_pair_is_refused_at_start(files: tuple[Path, Path]) -> None:
    (a_crt, _a_key), (_b_crt, b_key) = self_signed_pem("a"), self_signed_pem("b")
    crt, key = files
    crt.write_bytes(a_crt)
    key.write_bytes(b_key)
    with pytest.raises(ConfigError, match=r"cannot load certificate.*does not belong"):
        RelayTls.from_files(crt, key)


def test_a_key_of_another_type_or_a_ca_first_chain_is_named(files: tuple[Path, Path]) -> None:
    """OpenSSL says "no certificate assigned" for a renewal that switched to RSA with the
    old ECDSA key left behind, and "key values mismatch" for a chain with the CA first."""
    (ec_crt, _), (rsa_crt, rsa_key) = self_signed_pem("a"), self_signed_pem("b", RSA_KEY)
    crt, key = files
    crt.write_bytes(rsa_crt)
    key.write_bytes(self_signed_pem("c")[1])
    with pytest.raises(ConfigError, match="does not belong to the chain's first certificate"):
        RelayTls.from_files(crt, key)
    crt.write_bytes(ec_crt + rsa_crt)  # this key's certificate second
    key.write_bytes(rsa_key)
    with pytest.raises(ConfigError, match="not first in the chain"):
        RelayTls.from_files(crt, key)


def test_the_url_host_is_checked_against_the_certificate(files: tuple[Path, Path]) -> None:
    """A relay printed a URL whose host its certificate does not name (a 0.0.0.0 bind
    gives 127.0.0.1; a public-host typo) without a word; clients then refused it."""
    import ipaddress

    crt, key = files
    sans: list[x509.GeneralName] = [
        x509.DNSName("relay.example.com"),
        x509.DNSName("*.relay.test"),
        x509.IPAddress(ipaddress.ip_address("10.0.0.5")),
        x509.DNSName("xn--mnchen-3ya.de"),  # münchen.de, as certificates hold it
    ]
    pem, key_pem = self_signed_pem("names", sans=sans)
    crt.write_bytes(pem)
    key.write_bytes(key_pem)
    tls = RelayTls.from_files(crt, key)
    assert tls.names == ("relay.example.com", "*.relay.test", "xn--mnchen-3ya.de", "10.0.0.5")
    covered = ("relay.example.com", "RELAY.example.com.", "eu.relay.test", "10.0.0.5")
    for host in (*covered, "münchen.de", "xn--mnchen-3ya.de"):  # a public-host in Unicode
        assert tls.covers(host), host
    for host in ("127.0.0.1", "other.example", "a.b.relay.test", "relay.test", "10.0.0.6"):
        assert not tls.covers(host), host


def test_an_encrypted_key_is_refused_naming_it_and_never_prompts(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenSSL asked for a passphrase on the relay's terminal (start and every reload
    blocked on it, the event loop too); without a terminal it said "Invalid argument"."""
    import relay.tlsconfig as tlsconfig

    crt, key = files
    a_crt, a_key = self_signed_pem("a")
    private = serialization.load_pem_private_key(a_key, password=None)
    locked = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    crt.write_bytes(a_crt)
    key.write_bytes(locked)
    with pytest.raises(ConfigError, match=r"live.key: the key is encrypted \(passphrase"):
        RelayTls.from_files(crt, key)
    # OpenSSL's own load, past the diagnosis, gets a passphrase callback that refuses.
    monkeypatch.setattr(tlsconfig, "_key_mismatch", lambda chain, key: None)
    with pytest.raises(ConfigError, match="encrypted"):
        RelayTls.from_files(crt, key)
    monkeypatch.undo()
    key.write_bytes(a_key)
    tls = RelayTls.from_files(crt, key)
    key.write_bytes(locked)  # a renewal that wrote an encrypted key: the old one serves on
    assert tls.reload() is False
    assert served_certificate(tls.context) == _fingerprint(a_crt)


def test_a_key_path_that_is_a_dangling_link_is_named_as_one(tmp_path: Path) -> None:
    """exists() follows the link: the relay then tried to create the key and said the
    file exists, "pass overwrite=True" (a Python argument, to an operator)."""
    from relay.tlsconfig import load_or_create_key

    link = tmp_path / "relay.key"
    link.symlink_to(tmp_path / "keys" / "relay.key")
    with pytest.raises(ConfigError, match=r"relay.key is a symbolic link to .*keys/relay.key"):
        load_or_create_key(link)
    assert link.is_symlink() and not (tmp_path / "keys").exists()
    made = load_or_create_key(tmp_path / "new.key")  # and a missing file is created
    assert load_or_create_key(tmp_path / "new.key").endpoint_id == made.endpoint_id
