"""The relay's TLS side: a pinned Ed25519 key or a real certificate, and its fingerprint.

* Pinned mode: the relay presents the self-signed certificate of its own Ed25519 key
  (:func:`p2pdist.tls.make_certificate`, the same kind peers present); the URL carries
  ``?pin=<relay endpoint id>`` and clients check the key against it.
* Certificate mode: a PEM chain and key (e.g. from Let's Encrypt); clients verify it
  through the system CAs. :meth:`RelayTls.reload` (SIGHUP after a renewal) loads the
  files into a fresh SSL context, and the listener's context hands every new
  connection over to it from its ``sni_callback`` (called for every ClientHello, with
  or without SNI). A fresh context, not the live one reloaded: OpenSSL keeps one
  certificate per key type in a context, so loading an RSA certificate into a context
  that holds an ECDSA one would keep serving the ECDSA one to most clients while the
  fingerprint named the RSA one. The files are read once per load: a half-replaced
  pair (new certificate, old key) fails to load and leaves the old certificate
  serving, and the fingerprint always belongs to the certificate served.

Either way, the core needs the SHA-256 of the leaf certificate (DER) the clients see,
because their AUTH proof is bound to it (``auth_message``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from p2pdist.errors import KeyFileError, UsageError
from p2pdist.identity import EndpointId, SecretKey, exposed_key_file
from p2pdist.tls import load_identity, make_certificate
from p2pdist.wire.relay import ascii_host, cert_fingerprint

from .config import ConfigError
from .logfmt import kv

__all__ = ["RelayTls", "load_or_create_key"]

ENCRYPTED_KEY = (
    "the key is encrypted (passphrase-protected): the relay needs an unencrypted PEM key "
    "(mode 0600), as certbot writes"
)

log = logging.getLogger(__name__)


def _server_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_NONE  # clients prove their identity with AUTH, not certs
    return ctx


def load_or_create_key(path: Path | None) -> SecretKey:
    """The relay's pinned key: loaded from ``path``, created there (mode 0600) if missing,
    or ephemeral when ``path`` is None (with a warning: the pin changes on restart)."""
    if path is None:
        log.warning(kv("ephemeral_key", hint="the pin changes on every restart; pass --key FILE"))
        return SecretKey.generate()
    try:
        if path.exists():
            return SecretKey.load(path)
        key = SecretKey.generate()
        key.save(path)
    except KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot create key file {path}: {exc}") from None
    log.info(kv("key_created", path=path, id=key.endpoint_id.short()))
    return key


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None


def _check_private(path: Path) -> None:
    """ConfigError when the private key file ``path`` is accessible by group or others
    (the same rule as ``--key``); a file that cannot be stat'ed is left to the read."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if (problem := exposed_key_file(path, mode)) is not None:
        raise ConfigError(f"certificate key file {problem}")


class _NotValidNow(ConfigError):
    """A reload found a certificate that is not valid now: expired, or valid only from
    ``retry_at`` (None for an expired one, which never becomes valid)."""

    def __init__(self, message: str, retry_at: datetime.datetime | None) -> None:
        super().__init__(message)
        self.retry_at = retry_at


def _leaf_der(chain_pem: bytes, cert_path: Path, *, reloading: bool = False) -> bytes:
    """The leaf (first) certificate of a PEM chain, as DER. One that is not valid now
    (expired, or not yet valid) is logged at start and refused on a reload (ConfigError:
    clients would refuse it, so the certificate in use stays); one that expires within
    14 days is logged."""
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as exc:
        raise ConfigError(f"{cert_path} holds no PEM certificate: {exc}") from None
    leaf = certs[0]
    now = datetime.datetime.now(datetime.UTC)
    after, before = leaf.not_valid_after_utc, leaf.not_valid_before_utc
    if now > after or now < before:
        expired = now > after
        if reloading:
            why = f"expired at {after}" if expired else f"is valid from {before}"
            message = f"certificate {cert_path} {why}: clients would refuse it"
            raise _NotValidNow(message, None if expired else before)
        if expired:
            log.error(kv("certificate_expired", path=cert_path, not_after=after))
        else:
            log.error(kv("certificate_not_yet_valid", path=cert_path, not_before=before))
    elif (left := after - now).days < 14:
        log.warning(kv("certificate_expires_soon", path=cert_path, days=left.days))
    return leaf.public_bytes(serialization.Encoding.DER)


def certificate_names(der: bytes) -> tuple[str, ...]:
    """The DNS names and IP addresses in a certificate's subjectAltName."""
    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return (*san.get_values_for_type(x509.DNSName), *ips)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@dataclass
class RelayTls:
    """The server SSL context and what clients will sign against."""

    context: ssl.SSLContext
    fingerprint: bytes
    pin: EndpointId | None = None
    cert_path: Path | None = None
    key_path: Path | None = None
    previous: tuple[bytes, ...] = field(default_factory=tuple)
    names: tuple[str, ...] = ()
    """A real certificate's names (subjectAltName DNS names and IP addresses)."""
    _serving: ssl.SSLContext | None = field(default=None, repr=False)
    """The context new handshakes are switched to (None: ``context`` itself)."""
    _files_seen: tuple[object, ...] = field(default=(), repr=False)
    """The certificate and key files' stat signatures when they were last read."""
    _loaded: bytes = field(default=b"", repr=False)
    """SHA-256 of the chain and key bytes in use (certificate mode)."""
    _retry_at: datetime.datetime | None = field(default=None, repr=False)
    """When a certificate a reload found not valid yet becomes valid: the files are read
    again then, though they did not change (a renewal a little ahead of the clock)."""
    _reload_failed: bool = field(default=False, repr=False)
    """The last reload failed: the next one that finds the certificate in use says so."""

    @classmethod
    def pinned(cls, key: SecretKey) -> RelayTls:
        """Present the self-signed certificate of ``key``; clients pin its endpoint id."""
        cert = make_certificate(key)
        ctx = _server_context()
        load_identity(ctx, key, cert)
        der = cert.public_bytes(serialization.Encoding.DER)
        return cls(ctx, cert_fingerprint(der), pin=key.endpoint_id)

    @classmethod
    def from_files(cls, cert_path: Path, key_path: Path) -> RelayTls:
        """A real certificate chain (PEM) and its private key (PEM); ConfigError when the
        key file is accessible by group or others, as for ``--key``."""
        ctx = _server_context()
        seen = _signature(cert_path, key_path)  # before reading: a change meanwhile shows
        chain_pem, key_pem, der = _read_pair(cert_path, key_path)
        loaded = hashlib.sha256(chain_pem + b"\0" + key_pem).digest()
        _load_chain(ctx, chain_pem, key_pem, cert_path, key_path)
        names = certificate_names(der)
        return cls(
            ctx,
            cert_fingerprint(der),
            cert_path=cert_path,
            key_path=key_path,
            names=names,
            _files_seen=seen,
            _loaded=loaded,
        )

    def files_changed(self) -> bool:
        """Certificate mode: whether the certificate or key file changed (modification
        time, size or inode, so a renewal that swaps a symlink counts) since they were
        last read, or a certificate a reload refused as not valid yet has become valid.
        Only stats the files."""
        if self.cert_path is None or self.key_path is None:
            return False
        retry_at = self._retry_at
        if retry_at is not None and datetime.datetime.now(datetime.UTC) >= retry_at:
            return True
        return _signature(self.cert_path, self.key_path) != self._files_seen

    def covers(self, host: str) -> bool:
        """Whether clients that check host names accept this certificate for ``host``
        (always, with a pin: pinned clients check the key, not a name)."""
        if self.pin is not None:
            return True
        with contextlib.suppress(UsageError):
            host = ascii_host(host)  # as clients send and check it: "münchen.de" is IDNA
        try:
            return ipaddress.ip_address(host) in {_ip(n) for n in self.names}
        except ValueError:
            pass
        want = host.rstrip(".").lower().split(".")
        for name in self.names:
            have = name.rstrip(".").lower().split(".")
            if len(have) == len(want) and all(
                h == w or (i == 0 and h == "*")
                for i, (h, w) in enumerate(zip(have, want, strict=True))
            ):
                return True
        return False

    @property
    def fingerprints(self) -> tuple[bytes, ...]:
        """The current certificate's fingerprint, then the one before the last reload
        (the core accepts that one only for a grace after the reload: see
        :meth:`relay.state.RelayCore.set_cert_fingerprints`)."""
        return (self.fingerprint, *self.previous)

    def reload(self) -> bool:
        """Re-read certificate files (certificate mode); True when the certificate changed.
        Errors (unreadable files, a key file readable by others, a key that does not
        match the certificate, a certificate expired or not valid yet) are logged and the
        old certificate stays in use. The new pair is loaded into a fresh context, which
        then serves every new handshake (whatever its key type: see the module doc)."""
        if self.cert_path is None or self.key_path is None:
            return False
        self._files_seen = _signature(self.cert_path, self.key_path)
        self._retry_at = None
        try:
            chain_pem, key_pem, der = _read_pair(self.cert_path, self.key_path, reloading=True)
            fresh = _server_context()
            _load_chain(fresh, chain_pem, key_pem, self.cert_path, self.key_path)
        except ConfigError as exc:
            if isinstance(exc, _NotValidNow):
                self._retry_at = exc.retry_at
            log.error(kv("certificate_reload_failed", error=exc))
            self._reload_failed = True
            return False
        failed_before, self._reload_failed = self._reload_failed, False
        fp = cert_fingerprint(der)
        loaded = hashlib.sha256(chain_pem + b"\0" + key_pem).digest()
        if loaded == self._loaded:
            if failed_before:  # the operator's fix worked (else a SIGHUP for the allowlist)
                log.info(kv("certificate_unchanged", path=self.cert_path))
            return False
        self._loaded = loaded
        self._serving = fresh  # a new chain or key for the same leaf is served too
        self.context.sni_callback = self._hand_over
        if fp == self.fingerprint:
            log.info(kv("certificate_chain_reloaded", path=self.cert_path))
            return False
        self.previous = (self.fingerprint,)
        self.fingerprint = fp
        self.names = certificate_names(der)
        log.info(kv("certificate_reloaded", path=self.cert_path))
        return True

    def _hand_over(self, conn: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: object) -> None:
        """``sni_callback`` of the listener's context: serve the certificate loaded last."""
        if self._serving is not None:
            conn.context = self._serving


def _signature(*paths: Path) -> tuple[object, ...]:
    """(mtime, ctime, size, inode, device) of each file, following symlinks (ctime: a
    chmod or chown that fixes a refused key counts too); None for one that cannot be
    stat'ed."""
    out: list[object] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev))
    return tuple(out)


def _read_pair(
    cert_path: Path, key_path: Path, *, reloading: bool = False
) -> tuple[bytes, bytes, bytes]:
    """The certificate chain (PEM), its key (PEM) and the leaf certificate (DER), read
    from files; ConfigError when the key file is accessible by group or others (checked
    before the key is read) or a file cannot be read or parsed, and on a reload when the
    certificate is not valid now (see :func:`_leaf_der`)."""
    _check_private(key_path)
    chain_pem = _read(cert_path, "certificate")
    key_pem = _read(key_path, "key")
    return chain_pem, key_pem, _leaf_der(chain_pem, cert_path, reloading=reloading)


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path that reads as ``data``, for ``load_cert_chain`` (which takes only paths): an
    anonymous in-memory file where the OS has them (the key never touches a disk), else
    a private temporary file that is removed right after."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("relay-pem", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="relay-pem-") as tmp:  # pragma: no cover
        path = Path(tmp) / "pem"
        path.touch(mode=0o600)
        path.write_bytes(data)
        yield str(path)


def _load_chain(
    ctx: ssl.SSLContext, chain_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path
) -> None:
    """Load a chain and key given as PEM bytes (read from the paths named in errors)."""
    mismatch = _key_mismatch(chain_pem, key_pem)
    if mismatch is not None:
        raise ConfigError(f"cannot load certificate {cert_path} with key {key_path}: {mismatch}")
    try:
        with _pem_file(chain_pem) as chain, _pem_file(key_pem) as key:
            # A password callback: for an encrypted key OpenSSL would otherwise ask on
            # the controlling terminal, holding the event loop until someone typed.
            ctx.load_cert_chain(chain, key, password=_no_passphrase)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load certificate {cert_path} with key {key_path}: {exc}"
        ) from None


def _no_passphrase() -> bytes:
    raise ssl.SSLError("the key is encrypted")


def _key_mismatch(chain_pem: bytes, key_pem: bytes) -> str | None:
    """Why the key does not go with the chain's first certificate, or None (also when
    either does not parse: OpenSSL then says what is wrong). OpenSSL's own words are "no
    certificate assigned" for a key of another type and "key values mismatch" for a
    chain with the CA first: neither says which file to fix."""
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:  # cryptography's word for a key that needs a password
        return ENCRYPTED_KEY
    except Exception:  # unreadable or unusual: only a diagnosis, OpenSSL says the rest
        return None
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
        mine = private.public_key().public_bytes(der, public)
        keys = [c.public_key().public_bytes(der, public) for c in certs]
    except Exception:
        return None
    if keys[0] == mine:
        return None
    if mine in keys[1:]:
        return "the certificate for this key is not first in the chain (put the leaf first)"
    return "the key does not belong to the chain's first certificate (a renewal half done?)"
