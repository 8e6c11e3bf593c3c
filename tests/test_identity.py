"""Endpoint ids, secret keys, seed derivation, key files and certificates."""

from __future__ import annotations

import base64
import contextlib
import datetime
import errno
import logging
import os
import re
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID
from relay_helpers import memory_handshake

from p2pdist import identity as identity_module
from p2pdist import tls
from p2pdist.errors import KeyFileError, UsageError
from p2pdist.identity import EndpointId, SecretKey, derive_endpoint_ids, endpoint_id_of
from p2pdist.tls import TlsIdentity, endpoint_id_of_cert

SEED = "test seed: correct horse battery staple"
TEXT_FORM = re.compile(r"^[a-z2-7]{52}$")


def some_keys(n: int = 5) -> list[SecretKey]:
    return [SecretKey.from_seed(SEED, r) for r in range(n)] + [SecretKey.generate()]


# ---- EndpointId text form -------------------------------------------------------------


@pytest.mark.parametrize("key", some_keys(), ids=[*(f"rank{r}" for r in range(5)), "generated"])
def test_endpoint_id_text_round_trip(key: SecretKey) -> None:
    eid = key.endpoint_id
    text = str(eid)
    assert TEXT_FORM.match(text), text
    parsed = EndpointId.parse(text)
    assert parsed == eid
    assert bytes(parsed) == bytes(eid)
    assert str(parsed) == text
    assert hash(parsed) == hash(eid)
    assert repr(eid) == f"EndpointId({text})"
    assert EndpointId(bytes(eid)) == eid


def test_endpoint_id_equality_and_hash() -> None:
    a, b = SecretKey.from_seed(SEED, 0).endpoint_id, SecretKey.from_seed(SEED, 1).endpoint_id
    assert a != b
    assert a == EndpointId(bytes(a))
    assert a != bytes(a)  # an id is not equal to its raw bytes
    assert {a: 1, b: 2}[EndpointId.parse(str(b))] == 2


def test_short_is_prefix_of_text_form() -> None:
    eid = SecretKey.from_seed(SEED, 3).endpoint_id
    assert len(eid.short()) == 10
    assert str(eid).startswith(eid.short())


@pytest.mark.parametrize(
    "text",
    ["", "abc", "a" * 51, "a" * 53, "a" * 104],
    ids=["empty", "short", "51", "53", "double"],
)
def test_parse_wrong_length(text: str) -> None:
    with pytest.raises(UsageError, match="52 base32 characters"):
        EndpointId.parse(text)


@pytest.mark.parametrize("bad", ["0", "1", "8", "9", "!", "=", "é", "_"])
def test_parse_bad_characters(bad: str) -> None:
    good = str(SecretKey.from_seed(SEED, 0).endpoint_id)
    text = good[:20] + bad + good[21:]
    assert len(text) == 52
    with pytest.raises(UsageError, match="not valid base32"):
        EndpointId.parse(text)


def test_parse_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        EndpointId.parse("nope")


def test_parse_refuses_non_canonical_alias() -> None:
    """52 characters hold 260 bits for a 256-bit key: the last 4 bits must be zero,
    otherwise 16 different texts would name the same endpoint."""
    eid = SecretKey.from_seed(SEED, 0).endpoint_id
    text = str(eid)
    alphabet = "abcdefghijklmnopqrstuvwxyz234567"
    last = alphabet.index(text[-1])
    assert last % 16 == 0  # canonical: low 4 bits clear
    alias = text[:-1] + alphabet[last + 1]
    with pytest.raises(UsageError, match="not canonical"):
        EndpointId.parse(alias)


def test_parse_refuses_non_str() -> None:
    eid = SecretKey.from_seed(SEED, 0).endpoint_id
    with pytest.raises(UsageError, match="must be str"):
        EndpointId.parse(str(eid).encode())  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", [b"", b"\x00" * 31, b"\x00" * 33, 12345, "x" * 32])
def test_endpoint_id_from_bad_raw(raw: object) -> None:
    with pytest.raises(UsageError, match="32 bytes"):
        EndpointId(raw)  # type: ignore[arg-type]


# Encodings of the small-order points of edwards25519: y = 1 (the identity), y = p - 1
# (order 2), y = 0 (order 4, either sign of x), and the two y values of order 8; and
# encodings with y >= p, which no canonical encoder writes.
_P = 2**255 - 19
SMALL_ORDER = [
    (1).to_bytes(32, "little"),
    (1 | 1 << 255).to_bytes(32, "little"),
    (_P - 1).to_bytes(32, "little"),
    bytes(32),
    (1 << 255).to_bytes(32, "little"),
    bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
    bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
]
NON_CANONICAL = [_P.to_bytes(32, "little"), (_P + 1).to_bytes(32, "little"), b"\xff" * 32]


@pytest.mark.parametrize("raw", SMALL_ORDER, ids=lambda r: r.hex()[:8])
def test_small_order_keys_are_not_endpoint_ids(raw: bytes) -> None:
    # What refusing them prevents: signatures nobody made that verify for such a key.
    forged = (1).to_bytes(32, "little") + bytes(32)  # R = the identity, S = 0
    key = Ed25519PublicKey.from_public_bytes(raw)
    verified = 0
    for i in range(64):
        with contextlib.suppress(InvalidSignature):
            key.verify(forged, b"message %d" % i)
            verified += 1
    assert verified > 0
    with pytest.raises(UsageError, match="small order"):
        EndpointId(raw)
    with pytest.raises(UsageError, match="small order"):
        EndpointId.parse(base64.b32encode(raw).decode().rstrip("=").lower())


@pytest.mark.parametrize("raw", NON_CANONICAL, ids=lambda r: r.hex()[:8])
def test_non_canonical_encodings_are_not_endpoint_ids(raw: bytes) -> None:
    with pytest.raises(UsageError, match="non-canonical"):
        EndpointId(raw)


@pytest.mark.parametrize("y", [2, 7, 8, 11])
def test_a_y_with_no_point_on_the_curve_is_not_an_endpoint_id(y: int) -> None:
    """x^2 = (y^2 - 1) / (d y^2 + 1) must have a square root: OpenSSL loaded these all
    the same (an id no signature can ever verify under, failing later and vaguely)."""
    raw = y.to_bytes(32, "little")
    Ed25519PublicKey.from_public_bytes(raw)  # (what OpenSSL takes)
    with pytest.raises(UsageError, match="not a point of the curve"):
        EndpointId(raw)


def test_generated_and_derived_keys_are_all_accepted() -> None:
    keys = [SecretKey.generate() for _ in range(200)] + [
        SecretKey.from_seed(SEED, r) for r in range(200)
    ]
    for key in keys:
        assert EndpointId(bytes(key.endpoint_id)) == key.endpoint_id


# ---- signatures -------------------------------------------------------------------------


def test_sign_and_verify() -> None:
    key, other = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 1)
    msg = b"the message"
    sig = key.sign(msg)
    assert len(sig) == 64
    assert key.endpoint_id.verify(sig, msg)
    assert not key.endpoint_id.verify(sig, msg + b"!")
    assert not key.endpoint_id.verify(sig, b"The message")
    tampered = bytes([sig[0] ^ 1]) + sig[1:]
    assert not key.endpoint_id.verify(tampered, msg)
    assert not other.endpoint_id.verify(sig, msg)
    assert not key.endpoint_id.verify(sig[:10], msg)
    assert not key.endpoint_id.verify(b"", msg)


# ---- seed derivation ----------------------------------------------------------------------


def test_from_seed_is_deterministic() -> None:
    a, b = SecretKey.from_seed(SEED, 2), SecretKey.from_seed(SEED, 2)
    assert a.endpoint_id == b.endpoint_id
    assert a.sign(b"x") == b.sign(b"x")  # Ed25519 is deterministic: same secret
    assert SecretKey.from_seed(SEED.encode(), 2).endpoint_id == a.endpoint_id


def test_from_seed_differs_per_rank_and_seed() -> None:
    ids = {SecretKey.from_seed(SEED, r).endpoint_id for r in range(32)}
    assert len(ids) == 32
    other = {SecretKey.from_seed(SEED + "!", r).endpoint_id for r in range(32)}
    assert not ids & other


def test_from_seed_is_hkdf_sha256_as_specified() -> None:
    """Pins the derivation so that every version of p2pdist agrees on the ids of a seed."""
    for rank in (0, 1, 255, 256, 2**40):
        hkdf = HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=b"p2pdist/v1/seed-salt",
            info=b"p2pdist/v1/rank-endpoint-key/" + rank.to_bytes(8, "big"),
        )
        expected = SecretKey.from_bytes(hkdf.derive(SEED.encode()))
        assert SecretKey.from_seed(SEED, rank).endpoint_id == expected.endpoint_id


def test_from_seed_is_not_seed_repetition() -> None:
    """The flaw this replaces: a key made by repeating the seed bytes."""
    seed = b"0123456789abcdef"
    repeated = SecretKey.from_bytes((seed * 2)[:32])
    assert SecretKey.from_seed(seed, 0).endpoint_id != repeated.endpoint_id


@pytest.mark.parametrize("seed", ["", "short", b"1234567", "1234567"])
def test_from_seed_rejects_short_seed(seed: str | bytes) -> None:
    with pytest.raises(UsageError, match="at least 8 bytes"):
        SecretKey.from_seed(seed, 0)


def test_from_seed_accepts_eight_bytes() -> None:
    assert SecretKey.from_seed(b"12345678", 0).endpoint_id


@pytest.mark.parametrize("rank", [-1, -(2**70), True, 1.0, "1", 2**64])
def test_from_seed_rejects_bad_rank(rank: object) -> None:
    with pytest.raises(UsageError, match="rank"):
        SecretKey.from_seed(SEED, rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [10, 12345678901, None, 3.5])
def test_from_seed_rejects_non_text_seed(seed: object) -> None:
    # bytes(10) is ten zero bytes: an int must not silently become a (public) seed.
    with pytest.raises(UsageError, match="seed must be str or bytes"):
        SecretKey.from_seed(seed, 0)  # type: ignore[arg-type]


def test_derive_endpoint_ids_matches_from_seed() -> None:
    ids = derive_endpoint_ids(SEED, 6)
    assert ids == [SecretKey.from_seed(SEED, r).endpoint_id for r in range(6)]
    assert len(set(ids)) == 6
    assert derive_endpoint_ids(SEED, 1) == ids[:1]
    with pytest.raises(UsageError):
        derive_endpoint_ids(SEED, 0)


def test_from_bytes_round_trip() -> None:
    key = SecretKey.generate()
    raw = key.private_key().private_bytes_raw()
    assert SecretKey.from_bytes(raw).endpoint_id == key.endpoint_id
    with pytest.raises(UsageError, match="32 bytes"):
        SecretKey.from_bytes(raw[:31])


# ---- key files ------------------------------------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_save_load_round_trip(tmp_path: Path) -> None:
    key = SecretKey.generate()
    path = tmp_path / "key.pem"
    key.save(path)
    assert mode_of(path) == 0o600
    loaded = SecretKey.load(path)
    assert loaded.endpoint_id == key.endpoint_id
    assert loaded.sign(b"m") == key.sign(b"m")


def test_save_mode_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        SecretKey.generate().save(tmp_path / "k")
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "k") == 0o600


def test_save_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    first, second = SecretKey.generate(), SecretKey.generate()
    first.save(path)
    with pytest.raises(KeyFileError, match="overwrite=True"):
        second.save(path)
    assert SecretKey.load(path).endpoint_id == first.endpoint_id


def test_a_save_that_fails_leaves_no_key_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose write failed (a full disk) left an empty 0600 file at the path, and
    every later start refused it ("not an unencrypted PEM private key") until someone
    deleted it by hand."""
    path, key = tmp_path / "relay.key", SecretKey.generate()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(KeyFileError, match="No space left on device"):
            key.save(path)
    assert list(tmp_path.iterdir()) == []
    key.save(path)  # the next try works, and leaves only the key
    assert [p.name for p in tmp_path.iterdir()] == ["relay.key"] and mode_of(path) == 0o600
    assert SecretKey.load(path).endpoint_id == key.endpoint_id


def test_save_without_hard_links_writes_in_place_and_never_over_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = SecretKey.generate()
    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "missing")
    with pytest.raises(KeyFileError, match="exists"):
        key.save(dangling)
    assert dangling.is_symlink() and not (tmp_path / "missing").exists()

    def no_links(src: object, dst: object, **kw: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)  # a vfat or FUSE mount
    key.save(tmp_path / "k.pem")
    assert SecretKey.load(tmp_path / "k.pem").endpoint_id == key.endpoint_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.key", "k.pem"]


def test_a_key_file_with_two_keys_is_refused(tmp_path: Path) -> None:
    """`keygen >> FILE` twice: load took the first key in silence, while the second
    keygen had printed the other key's id."""
    path = tmp_path / "k.pem"
    path.write_bytes(SecretKey.generate().to_pem() + SecretKey.generate().to_pem())
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="holds 2 PEM blocks, not one key"):
        SecretKey.load(path)


def test_save_overwrite_tightens_mode(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")
    path.chmod(0o644)
    key = SecretKey.generate()
    key.save(path, overwrite=True)
    assert mode_of(path) == 0o600
    assert SecretKey.load(path).endpoint_id == key.endpoint_id


def test_save_overwrite_writes_a_new_file_and_never_follows_a_link(tmp_path: Path) -> None:
    """Overwriting truncated the old file and wrote into it: a reader who had opened it
    while it was readable read the new key, and a symbolic link was followed (the key
    went into whatever file it pointed at)."""
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")
    path.chmod(0o644)
    with open(path, "rb") as reader:  # opened while it was readable
        key = SecretKey.generate()
        key.save(path, overwrite=True)
        assert reader.read() == b"old"  # the old file, not the new key
    target = tmp_path / "elsewhere"
    target.write_bytes(b"someone's file")
    link = tmp_path / "link.pem"
    link.symlink_to(target)
    key.save(link, overwrite=True)
    assert target.read_bytes() == b"someone's file" and not link.is_symlink()
    assert SecretKey.load(link).endpoint_id == key.endpoint_id
    (tmp_path / "dir.pem").mkdir()
    with pytest.raises(KeyFileError, match="cannot write key file"):
        key.save(tmp_path / "dir.pem", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dir.pem",
        "elsewhere",
        "key.pem",
        "link.pem",
    ]  # no file of our own left behind


def test_save_overwrite_interrupted_leaves_no_copy_of_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C between writing the new file and renaming it left that file (the key)
    beside the path: only an OSError cleaned up."""
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")

    def interrupted(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(identity_module.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        SecretKey.generate().save(path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["key.pem"] and path.read_bytes() == b"old"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o700 | 0o010])
def test_load_refuses_permissive_file(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "key.pem"
    SecretKey.generate().save(path)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match=f"chmod 600 {re.escape(str(path))}"):
        SecretKey.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage\n", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"],
    ids=["empty", "text", "bad-pem"],
)
@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_load_garbage(tmp_path: Path, content: bytes, mode: int) -> None:
    # Readable by others too: no key, so nothing to make private (it asked to chmod
    # first, and only then said the file was no key: a user trial).
    path = tmp_path / "key.pem"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM private key"):
        SecretKey.load(path)


def test_load_reads_no_more_than_a_key_file_holds(tmp_path: Path) -> None:
    """A wrong --key (a big log, readable by others) was read whole before it was
    refused; now at most 64 KiB are read."""
    path = tmp_path / "big.log"
    path.write_bytes(b"x" * (1 << 20))
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="not a key file"):
        SecretKey.load(path)


def test_load_encrypted_key(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    pem = (
        SecretKey.generate()
        .private_key()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    with pytest.raises(KeyFileError):
        SecretKey.load(path)


def test_load_non_ed25519_key(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        SecretKey.load(path)


def test_load_missing_or_unreadable(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        SecretKey.load(tmp_path / "nope.pem")
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="is a directory, not a file"):
        SecretKey.load(d)
    (d / "file").write_bytes(b"")
    with pytest.raises(KeyFileError, match="cannot read"):
        SecretKey.load(d / "file" / "deeper")  # a path through a file: not a directory


# ---- secrets never shown ---------------------------------------------------------------------


def secret_renderings(key: SecretKey) -> list[str]:
    raw = key.private_key().private_bytes_raw()
    pem_body = "".join(
        key.private_key()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
        .splitlines()[1:-1]
    )
    forms = [
        raw.hex(),
        raw.hex().upper(),
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode(),
        base64.b32encode(raw).decode().rstrip("=").lower(),
        pem_body,
        repr(raw),
    ]
    # Also any 16-character window of the encodings, in case something prints a prefix.
    forms += [raw.hex()[:16], base64.b64encode(raw).decode()[:16]]
    return [f.rstrip("=") for f in forms]


def test_secret_key_repr_hides_secret() -> None:
    key = SecretKey.from_seed(SEED, 0)
    shown = [repr(key), str(key), f"{key}", f"{key!r}", repr([key]), repr({"k": key})]
    for text in shown:
        assert key.endpoint_id.short() in text
        assert "hidden" in text
        for secret in secret_renderings(key):
            assert secret not in text, (secret, text)


def test_secret_key_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    key = SecretKey.from_seed(SEED, 1)
    log = logging.getLogger("p2pdist.test")
    with caplog.at_level(logging.DEBUG, logger="p2pdist.test"):
        log.info("key %s", key)
        log.info("key %r", key)
        log.info("keys %s", [key])
        log.info(key)
    assert caplog.text.count(key.endpoint_id.short()) == 4
    for secret in secret_renderings(key):
        assert secret not in caplog.text


def test_secret_key_equality_by_identity() -> None:
    a, b = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 0)
    assert a == b and hash(a) == hash(b)
    assert a != SecretKey.from_seed(SEED, 1)


# ---- certificates ------------------------------------------------------------------------------


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> bool:
    """An in-memory TLS handshake; True when both sides complete it."""
    try:
        memory_handshake(client, server)
    except ssl.SSLError:
        return False
    return True


def test_server_contexts_are_kept_per_certificate_and_still_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tls, "SERVER_CONTEXTS", 2)
    server = TlsIdentity(SecretKey.from_seed(SEED, 0))
    a, b, c = (TlsIdentity(SecretKey.from_seed(SEED, r)) for r in (1, 2, 3))
    ctx_a = server.server_context(a.cert_der)
    assert server.server_context(a.cert_der) is ctx_a
    assert ctx_a.num_tickets == 0  # a kept context hands out no session tickets
    assert _handshake(a.client_context(), ctx_a)
    assert not _handshake(b.client_context(), ctx_a)  # a kept context pins as a new one does
    ctx_b = server.server_context(b.cert_der)
    assert server.server_context(a.cert_der) is ctx_a  # a is now the most recent
    server.server_context(c.cert_der)  # over the bound: b, the least recent, goes
    assert server.server_context(a.cert_der) is ctx_a
    assert server.server_context(b.cert_der) is not ctx_b


def test_certificate_carries_endpoint_id() -> None:
    key = SecretKey.from_seed(SEED, 0)
    ident = TlsIdentity(key)
    assert endpoint_id_of_cert(ident.cert_der) == key.endpoint_id
    assert TlsIdentity(key).cert_der == ident.cert_der  # deterministic


def test_endpoint_id_of_cert_refuses_other_key_types() -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not p2pdist")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ec_key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ec_key, hashes.SHA256())
    )
    with pytest.raises(ValueError, match="not Ed25519"):
        endpoint_id_of_cert(cert.public_bytes(serialization.Encoding.DER))


def test_a_certificate_not_signed_by_its_own_key_is_refused() -> None:
    """Anyone could build endless variants of a member's certificate (its public key,
    any serial or name, signed with a key of their own), each a server context of 2 ms
    for the acceptor to build and keep, pushing the real ones out of its cache."""
    member, stranger = SecretKey.from_seed(SEED, 6), SecretKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a variant")])
    variant = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(member.private_key().public_key())
        .serial_number(12345)
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC))
        .sign(stranger.private_key(), None)
        .public_bytes(serialization.Encoding.DER)
    )
    with pytest.raises(ValueError, match="not signed by its own key"):
        endpoint_id_of_cert(variant)
    assert endpoint_id_of_cert(TlsIdentity(member).cert_der) == member.endpoint_id


def unknown_key_type_cert(key: SecretKey) -> bytes:
    """The key's certificate with its public-key algorithm OID changed to an unknown one."""
    der = bytearray(TlsIdentity(key).cert_der)
    ed25519_oid = bytes.fromhex("06032b6570")  # 1.3.101.112
    first = der.find(ed25519_oid)  # signature algorithm
    spki = der.find(ed25519_oid, first + 1)  # subjectPublicKeyInfo algorithm
    assert first >= 0 and spki > first
    der[spki + 4] = 0x7F  # 1.3.101.127: no such key type
    return bytes(der)


def bad_utf8_subject_cert(key: SecretKey) -> bytes:
    """The key's certificate with invalid UTF-8 in its subject: cryptography still finds the
    key (it parses names lazily) but OpenSSL refuses to load the certificate."""
    der = bytearray(TlsIdentity(key).cert_der)
    der[der.find(f"p2pdist {key.endpoint_id}".encode()) + 5] = 0xFF
    return bytes(der)


def test_openssl_refused_certificate_is_refused() -> None:
    """Such a certificate used to pass endpoint_id_of_cert and then crash the TLS setup of
    the accepting side (ssl.SSLError escaping its handshake task)."""
    k = SecretKey.from_seed(SEED, 4)
    der = bad_utf8_subject_cert(k)
    assert x509.load_der_x509_certificate(der).public_key().public_bytes_raw() == bytes(
        k.endpoint_id
    )
    with pytest.raises(ValueError, match="OpenSSL"):
        endpoint_id_of_cert(der)
    with pytest.raises(ValueError, match="OpenSSL"):
        TlsIdentity(SecretKey.from_seed(SEED, 5)).server_context(der)


@pytest.mark.parametrize(
    "der",
    [
        b"",
        b"\x30\x03\x02\x01\x00",
        b"garbage" * 10,
        unknown_key_type_cert(SecretKey.generate()),
        bad_utf8_subject_cert(SecretKey.generate()),
    ],
    ids=["empty", "tiny-der", "garbage", "unknown-key-type", "bad-utf8-subject"],
)
def test_endpoint_id_of_cert_malformed_is_value_error(der: bytes) -> None:
    """The DER comes from the peer: every failure must be the documented ValueError."""
    with pytest.raises(ValueError):
        endpoint_id_of_cert(der)


def test_to_pem_is_what_save_writes_and_load_reads(tmp_path: Path) -> None:
    key = SecretKey.from_seed(SEED, 6)
    pem = key.to_pem()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    key.save(tmp_path / "k.pem")
    assert (tmp_path / "k.pem").read_bytes() == pem
    assert SecretKey.load(tmp_path / "k.pem") == key


def test_the_parsed_id_cache_is_bounded() -> None:
    """``endpoint_id_of`` (used for the sender of every relayed datagram) parses each id
    once while it is among the most recent 1024, and never holds more."""
    ids = [SecretKey.from_seed(SEED, i).endpoint_id for i in range(1, 1100)]
    for eid in ids:
        assert endpoint_id_of(bytes(eid)) == eid
    assert 0 < endpoint_id_of.cache_info().currsize <= 1024
    assert endpoint_id_of(bytes(ids[-1])) is endpoint_id_of(bytes(ids[-1]))
