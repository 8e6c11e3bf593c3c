"""TLS 1.3 with certificates pinned to endpoint ids.

Each endpoint presents a self-signed X.509 certificate carrying its Ed25519 endpoint key.
There is no CA: trust comes from pinning. The dialing side knows the id it wants and checks
the presented certificate key against it; the accepting side learns the claimed id from the
handshake, trusts exactly that one certificate for this one connection (so OpenSSL itself
verifies the client's proof of possession) and checks the key again afterwards.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import secrets
import ssl
import tempfile
from collections import OrderedDict

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from .identity import EndpointId, SecretKey

__all__ = ["TlsIdentity", "endpoint_id_of_cert", "load_identity", "make_certificate"]

_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)


def make_certificate(key: SecretKey) -> x509.Certificate:
    """A self-signed certificate for ``key`` (deterministic: Ed25519 signing is)."""
    eid = key.endpoint_id
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"p2pdist {eid}")])
    serial = int.from_bytes(hashlib.sha256(bytes(eid)).digest()[:16], "big") >> 1
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.private_key().public_key())
        .serial_number(serial)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .sign(key.private_key(), None)
    )


def endpoint_id_of_cert(der: bytes) -> EndpointId:
    """The endpoint id an X.509 certificate (DER) carries; ValueError if not Ed25519.

    The DER comes from the peer, so every way it can fail to parse (including a key type
    ``cryptography`` does not know, which raises ``UnsupportedAlgorithm``) becomes ValueError.
    """
    try:
        cert = x509.load_der_x509_certificate(der)
        pub = cert.public_key()
    except ValueError:
        raise
    except Exception as exc:  # UnsupportedAlgorithm, TypeError on non-bytes, ...
        raise ValueError(f"unusable certificate: {exc}") from None
    # cryptography parses lazily and more leniently than OpenSSL, which must load the same
    # bytes for the TLS handshake: a certificate only one of them accepts is refused here.
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=der)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"certificate refused by OpenSSL: {exc}") from None
    if not isinstance(pub, Ed25519PublicKey):
        raise ValueError(f"certificate key is {type(pub).__name__}, not Ed25519")
    # Signed by its own key, as make_certificate signs: else anyone could make endless
    # variants of a member's certificate (any serial, any name), each a fresh server
    # context to build (TlsIdentity.server_context) that pushes real ones out.
    try:
        pub.verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        raise ValueError("certificate is not signed by its own key") from None
    return EndpointId(pub.public_bytes_raw())


def load_identity(ctx: ssl.SSLContext, key: SecretKey, cert: x509.Certificate) -> None:
    """Make ``ctx`` present ``cert`` with ``key``.

    ssl can only load keys from files: write one encrypted with a one-time password into
    a private directory, load it, and remove it at once.
    """
    password = secrets.token_bytes(32)
    pem = key.private_key().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password),
    ) + cert.public_bytes(serialization.Encoding.PEM)
    with tempfile.TemporaryDirectory(prefix="p2pdist-tls-") as d:
        path = os.path.join(d, "identity.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        ctx.load_cert_chain(path, password=password)


SERVER_CONTEXTS = 256
"""Server contexts a :class:`TlsIdentity` keeps, one per client certificate (most recent)."""


class TlsIdentity:
    """An endpoint's certificate and the SSL contexts built from it."""

    def __init__(self, key: SecretKey) -> None:
        self._key = key
        self.certificate = make_certificate(key)
        self.cert_der = self.certificate.public_bytes(serialization.Encoding.DER)
        self._client_ctx: ssl.SSLContext | None = None
        self._server_ctxs: OrderedDict[bytes, ssl.SSLContext] = OrderedDict()

    def _load_identity(self, ctx: ssl.SSLContext) -> None:
        load_identity(ctx, self._key, self.certificate)

    def client_context(self) -> ssl.SSLContext:
        """Context for dialing: presents our cert; the server key is checked after the
        handshake against the expected id (no CA can vouch for a self-signed key)."""
        if self._client_ctx is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            self._load_identity(ctx)
            self._client_ctx = ctx
        return self._client_ctx

    def server_context(self, client_cert_der: bytes) -> ssl.SSLContext:
        """Context for accepting one connection whose client must present exactly
        ``client_cert_der`` and prove it holds that certificate's key.

        Raises ValueError when OpenSSL cannot load the certificate (check it with
        :func:`endpoint_id_of_cert` first, which refuses such certificates).

        Contexts are kept per certificate (at most :data:`SERVER_CONTEXTS`): building one
        loads our key (about 2 ms), which every incoming connection, and every stranger
        presenting a member's public certificate, would otherwise cost (variants of it
        need the member's key: :func:`endpoint_id_of_cert` checks the self-signature)."""
        cached = self._server_ctxs.get(client_cert_der)
        if cached is not None:
            self._server_ctxs.move_to_end(client_cert_der)
            return cached
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.num_tickets = 0  # no resumption: every connection proves its key afresh
        try:
            ctx.load_verify_locations(cadata=client_cert_der)
        except ssl.SSLError as exc:
            raise ValueError(f"certificate refused by OpenSSL: {exc}") from None
        self._load_identity(ctx)
        self._server_ctxs[bytes(client_cert_der)] = ctx
        if len(self._server_ctxs) > SERVER_CONTEXTS:
            self._server_ctxs.popitem(last=False)
        return ctx
