"""The handshake of a TCP connection: preamble, authentication, TLS, record keys.

:class:`TcpHandshake` is the part of :class:`~.tcp.TcpConnection` that runs before the
first frame. It exchanges the preamble records of :mod:`p2pdist.wire.handshake` (which
mode, who dials whom, nonces; the acceptor applies the accept policy), then either runs
TLS 1.3 pinned to endpoint ids (:class:`~.tlspipe.TlsPipe`) and, when both ends offer
them, agrees the keys of :class:`~.aeadpipe.AeadPipe` records inside TLS, or, in
plaintext mode, has each side sign the handshake transcript. It ends by handing the
connection to :class:`~.framed.FramedConnection`'s frames. The socket side (the asyncio
protocol callbacks that feed it bytes, the writes) stays in :mod:`.tcp`, and
:class:`~.tcp.TcpConnection` sets up the state declared here.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import ssl
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConnectionBrokenError,
    PeerAuthenticationError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId
from ..tls import endpoint_id_of_cert
from ..wire.handshake import (
    HandshakeError,
    RecordReader,
    auth_transcript,
    encode_record,
    get_bytes,
)
from .aeadpipe import CIPHER, AeadPipe, RecordError, new_secret
from .base import IDENTITY_MISMATCH
from .framed import FramedConnection
from .tlspipe import TlsPipe

if TYPE_CHECKING:
    from .tcp import TcpTransport

__all__ = ["TLS_MISMATCH_HINT", "TcpHandshake"]

TLS_MISMATCH_HINT = "tls= (or P2PDIST_TLS) must be the same on every rank"
"""Ends the refusal of a dialer that asked for the other mode (TLS or plaintext)."""

_KEY_READ = 1024
"""Plaintext read at a time while the record keys come in through TLS (one small record)."""
_HANDSHAKE_BUFFER_PAUSE = 1 << 20
"""Bytes buffered during the handshake above which the socket stops being read."""


class TcpHandshake(FramedConnection):
    """The handshake half of :class:`~.tcp.TcpConnection`, which sets up the state
    declared below in its ``__init__``, feeds the handshake its bytes (calling
    :meth:`_wake_handshake`) and supplies the hooks below."""

    _owner: TcpTransport
    _server_side: bool
    _expected: EndpointId | None
    _transport: asyncio.Transport | None
    _tls: TlsPipe | AeadPipe | None
    _ssl: ssl.SSLObject | None
    _hs_buf: bytearray
    _hs_reader: RecordReader
    _hs_wakeup: asyncio.Future[None] | None

    # ---- supplied by TcpConnection ------------------------------------------------------

    def _remote_text(self) -> str:
        """The peer's ``ip:port``, for labels."""
        raise NotImplementedError

    def _flush_tls(self) -> None:
        """Send what TLS has to say by itself (handshake messages, alerts)."""
        raise NotImplementedError

    def _tls_receive(self) -> None:
        """Decrypt the records received so far into the frame decoder."""
        raise NotImplementedError

    # ---- the handshake -------------------------------------------------------------------

    def _wake_handshake(self) -> None:
        w, self._hs_wakeup = self._hs_wakeup, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _next_record(self) -> dict[str, Any]:
        while (rec := self._parse_record(self._hs_reader)) is None:
            await self._more_handshake_bytes()
        return rec

    def _parse_record(self, reader: RecordReader) -> dict[str, Any] | None:
        """The reader's next whole handshake record (None: more bytes needed); malformed
        bytes are the peer's protocol error."""
        try:
            return reader.next_record()
        except HandshakeError as exc:
            raise RemoteProtocolError(self.label, str(exc)) from None

    async def _more_handshake_bytes(self) -> None:
        """Wait until more bytes arrive during the handshake (bounded by the caller's
        handshake timeout); raises the connection's error if it ended."""
        if self._error is not None:
            raise self._error.with_traceback(None)
        self._hs_wakeup = self._loop.create_future()
        await self._hs_wakeup

    async def _start_tls(self, ctx: ssl.SSLContext) -> None:
        """The TLS handshake over this connection's socket (:class:`TlsPipe`), then the
        check that the peer's certificate carries the id it must have."""
        assert self._transport is not None
        if len(self._hs_reader):
            raise RemoteProtocolError(self.label, "unexpected bytes before the TLS handshake")
        tls = self._tls = TlsPipe(ctx, server_side=self._server_side)
        while True:
            try:
                done = tls.handshake()
            except ssl.SSLError as exc:
                self._flush_tls()  # the alert tells the peer why
                raise PeerAuthenticationError(self.label, f"TLS handshake failed: {exc}") from None
            self._flush_tls()
            if done:
                break
            if self._error is None and self._transport.is_closing():
                raise ConnectionBrokenError(self.label, "connection lost during TLS handshake")
            if tls.buffered <= _HANDSHAKE_BUFFER_PAUSE:
                self._transport.resume_reading()
            await self._more_handshake_bytes()  # lost meanwhile: the connection's error
        self._ssl = tls.obj
        der = tls.obj.getpeercert(binary_form=True)
        if not der:
            raise PeerAuthenticationError(self.label, "peer presented no certificate")
        try:
            presented = endpoint_id_of_cert(der)
        except ValueError as exc:
            raise PeerAuthenticationError(self.label, f"unusable certificate: {exc}") from None
        assert self._peer is not None
        if presented != self._peer:
            raise PeerAuthenticationError(
                self.label,
                f"{IDENTITY_MISMATCH}: expected {self._peer}, presented {presented}",
            )

    async def client_handshake(self) -> None:
        """Authenticate the accepting side as ``expected`` (dialing side)."""
        owner, expected = self._owner, self._expected
        assert expected is not None
        nonce = secrets.token_bytes(32)
        hello: dict[str, Any] = {
            "mode": "tls" if self._cfg.tls else "plain",
            "id": bytes(owner.endpoint_id),
            "want": bytes(expected),
            "nonce": nonce,
        }
        if self._cfg.tls:
            hello["cert"] = owner.tls_identity.cert_der
            if self._cfg.sealed_records:
                hello["records"] = [CIPHER]
        self._write(encode_record(hello, first=True))
        rec = await self._next_record()
        if rec.get("ok") is not True:
            reason = rec.get("error")
            raise PeerAuthenticationError(self.label, f"refused us: {reason}")
        try:
            presented = EndpointId(get_bytes(rec, "id", 32))
            server_nonce = get_bytes(rec, "nonce", 32)
        except (HandshakeError, UsageError) as exc:
            raise RemoteProtocolError(self.label, str(exc)) from None
        if presented != expected:
            raise PeerAuthenticationError(
                self.label, f"{IDENTITY_MISMATCH}: expected {expected}, presented {presented}"
            )
        if self._cfg.tls:
            sealed = rec.get("records") == CIPHER and self._cfg.sealed_records
            await self._start_tls(owner.tls_identity.client_context())
            if sealed:
                await self._seal_records()
        else:
            me, them = bytes(owner.endpoint_id), bytes(expected)
            sig = owner.key.sign(auth_transcript(b"C", me, them, nonce, server_nonce))
            self._write(encode_record({"sig": sig}))
            rec = await self._next_record()
            try:
                server_sig = get_bytes(rec, "sig", 64)
            except HandshakeError as exc:
                raise RemoteProtocolError(self.label, str(exc)) from None
            if not expected.verify(
                server_sig, auth_transcript(b"S", me, them, nonce, server_nonce)
            ):
                raise PeerAuthenticationError(
                    self.label, f"could not prove it holds the key of {expected}"
                )
        self._enter_frames()

    async def server_handshake(self) -> None:
        """Learn and verify who dialed us (accepting side)."""
        owner = self._owner
        rec = await self._next_record()
        try:
            client = EndpointId(get_bytes(rec, "id", 32))
            want = get_bytes(rec, "want", 32)
            client_nonce = get_bytes(rec, "nonce", 32)
        except (HandshakeError, UsageError) as exc:
            raise RemoteProtocolError(self.label, str(exc)) from None
        self._peer = client
        # Only a claim until the TLS handshake or the signature proves it: an outsider
        # must not make our warnings appear to come from a group member.
        self.label = f"{self._remote_text()} claiming {owner.label_for(client)}"
        mode = rec.get("mode")
        my_mode = "tls" if self._cfg.tls else "plain"
        refusal = None
        if mode != my_mode:
            asked = repr(mode) if isinstance(mode, str | None) and len(mode or "") <= 16 else "?"
            refusal = (
                f"this endpoint runs {my_mode!r}, the dialer asked for {asked}: {TLS_MISMATCH_HINT}"
            )
        elif want != bytes(owner.endpoint_id):
            wanted = base64.b32encode(want).decode().rstrip("=").lower()
            refusal = f"{IDENTITY_MISMATCH}: expected {wanted}, presented {owner.endpoint_id}"
        else:
            refusal = owner.refusal_for(client)
        cert = rec.get("cert")
        if refusal is None and my_mode == "tls":
            try:
                if not isinstance(cert, bytes) or endpoint_id_of_cert(cert) != client:
                    refusal = "certificate key does not match the claimed endpoint id"
            except ValueError as exc:  # not Ed25519, not signed by its own key, ...
                refusal = f"certificate is not an Ed25519 certificate: {str(exc)[:200]}"
        if refusal is not None:
            self._write(encode_record({"ok": False, "error": refusal}))
            raise PeerAuthenticationError(self.label, f"refused: {refusal}")
        nonce = secrets.token_bytes(32)
        reply: dict[str, Any] = {"ok": True, "id": bytes(owner.endpoint_id), "nonce": nonce}
        offered = rec.get("records")
        sealed = (
            my_mode == "tls"
            and self._cfg.sealed_records
            and isinstance(offered, list)
            and CIPHER in offered
        )
        if sealed:
            reply["records"] = CIPHER
        self._write(encode_record(reply))
        if my_mode == "tls":
            assert isinstance(cert, bytes)
            await self._start_tls(owner.tls_identity.server_context(cert))
            if sealed:
                await self._seal_records()
        else:
            me, them = bytes(owner.endpoint_id), bytes(client)
            rec = await self._next_record()
            try:
                sig = get_bytes(rec, "sig", 64)
            except HandshakeError as exc:
                raise RemoteProtocolError(self.label, str(exc)) from None
            if not client.verify(sig, auth_transcript(b"C", them, me, client_nonce, nonce)):
                raise PeerAuthenticationError(
                    self.label, f"could not prove it holds the key of {client}"
                )
            mine = owner.key.sign(auth_transcript(b"S", them, me, client_nonce, nonce))
            self._write(encode_record({"sig": mine}))
        self.label = owner.label_for(client)  # proven: named as any other peer
        self._enter_frames()

    async def _seal_records(self) -> None:
        """Send our record secret inside TLS, read the peer's, and protect everything
        after them with :class:`AeadPipe` records (each side switches right after its own
        key message, so what follows the peer's in TLS's buffer is already records)."""
        tls = self._tls
        assert isinstance(tls, TlsPipe)
        mine = new_secret()
        self._write(encode_record({"key": mine}))  # one TLS record, the last one we send
        reader = RecordReader()
        buf = memoryview(bytearray(_KEY_READ))
        while (rec := self._parse_record(reader)) is None:
            try:
                got = tls.read_into(buf)
            except ssl.SSLError as exc:
                self._flush_tls()  # our alert, best effort: tells the peer why
                raise ConnectionBrokenError(self.label, f"TLS error: {exc}", corrupt=True) from None
            if got:
                reader.feed(buf[:got])
            elif tls.closed_by_peer:
                raise ConnectionBrokenError(self.label, "peer closed TLS before its record key")
            else:
                if self._transport is not None and tls.buffered <= _HANDSHAKE_BUFFER_PAUSE:
                    self._transport.resume_reading()
                await self._more_handshake_bytes()
        try:
            theirs = get_bytes(rec, "key", 32)
        except HandshakeError as exc:
            raise RemoteProtocolError(self.label, str(exc)) from None
        if len(reader) or tls.obj.pending():
            raise RemoteProtocolError(self.label, "TLS data after the record key")
        try:
            pipe = AeadPipe(mine, theirs, dialer=not self._server_side)
        except RecordError as exc:
            raise RemoteProtocolError(self.label, str(exc)) from None
        pipe.feed(tls.take_buffered())
        self._tls = pipe

    def _enter_frames(self) -> None:
        leftover = self._hs_reader.leftover()
        self._hs_buf = bytearray()
        self._start_frames()
        if self._transport is not None:
            self._transport.resume_reading()
        if self._tls is not None:
            self._tls_receive()  # frames that came with the handshake's last flight
        elif leftover:
            self._decode(self._decoder.feed, leftover)
