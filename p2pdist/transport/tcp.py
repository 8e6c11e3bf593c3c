"""TCP transport: TLS 1.3 pinned to endpoint ids (default) or authenticated plaintext.

Thin asyncio glue around the sans-I/O pieces: :mod:`p2pdist.wire.handshake` for the
preamble, :mod:`p2pdist.wire.frames` for framing, :mod:`.keepalive` for liveness and
:mod:`.mailbox` for per-channel delivery. Received payloads land directly in their own
buffers (``asyncio.BufferedProtocol``), so bulk data is copied once by the kernel.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..tls import TlsIdentity, endpoint_id_of_cert
from ..wire.frames import Frame, FrameDecoder, FrameError, FrameKind, encode_header
from ..wire.handshake import (
    HandshakeError,
    RecordReader,
    auth_transcript,
    encode_record,
    get_bytes,
)
from .base import Address, ConnectionStats, TransportConfig
from .keepalive import Keepalive, KeepaliveAction
from .mailbox import Mailbox

__all__ = ["TcpConnection", "TcpTransport", "parse_address"]

log = logging.getLogger(__name__)

_SMALL_WRITE = 64 * 1024
_WRITE_COPIES = sys.version_info < (3, 12)
_HANDSHAKE_BUFFER_PAUSE = 1 << 20
_PING = encode_header(FrameKind.PING)
_PONG = encode_header(FrameKind.PONG)
_GOODBYE = encode_header(FrameKind.GOODBYE)


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> (host, port)."""
    if isinstance(address, tuple):
        host, port = address
    else:
        text = address.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]:")
            port_text = rest if sep else ""
        else:
            host, _, port_text = text.rpartition(":")
        try:
            port = int(port_text)
        except ValueError:
            raise UsageError(f"address {address!r} is not host:port") from None
    if not host or not 0 <= int(port) <= 65535:
        raise UsageError(f"address {address!r} is not host:port")
    return host, int(port)


class TcpConnection(asyncio.BufferedProtocol):
    """One TCP connection to one authenticated peer (also its asyncio protocol)."""

    def __init__(
        self, owner: TcpTransport, *, server_side: bool, expected: EndpointId | None = None
    ) -> None:
        self._owner = owner
        self._cfg = owner.config
        self._server_side = server_side
        self._expected = expected
        self._peer: EndpointId | None = expected
        self.label = f"peer {expected.short()}" if expected else "incoming peer"
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # Handshake phase state.
        self._handshaking = True
        self._hs_buf = bytearray(64 * 1024)
        self._hs_reader = RecordReader(expect_magic=server_side)
        self._hs_wakeup: asyncio.Future[None] | None = None
        # Frame phase state.
        self._decoder = FrameDecoder(self._cfg.limits)
        self._mailbox = Mailbox(
            self._cfg.max_buffered, self._pause_reading, self._resume_reading, lambda: self.label
        )
        self._stats = ConnectionStats()
        self._keepalive: Keepalive | None = None
        self._ka_timer: asyncio.TimerHandle | None = None
        self._ping_sent_at: float | None = None
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._interrupted: BaseException | None = None
        self._closed_locally = False
        self._goodbye_received = False
        self._lost = self._loop.create_future()
        self._callbacks: list[Callable[[BaseException | None], None]] = []

    # ---- public Connection API -------------------------------------------------------

    @property
    def peer_id(self) -> EndpointId:
        """The authenticated endpoint id of the peer."""
        if self._peer is None:
            raise UsageError("connection not authenticated yet")
        return self._peer

    @property
    def closed(self) -> bool:
        """True once the connection can no longer send."""
        return self._error is not None or self._closed_locally

    @property
    def stats(self) -> ConnectionStats:
        """Counters (``dropped_stale`` included)."""
        self._stats.dropped_stale = self._mailbox.dropped
        return self._stats

    @property
    def encrypted(self) -> bool:
        """True when TLS protects this connection."""
        return (
            self._transport is not None and self._transport.get_extra_info("ssl_object") is not None
        )

    def idle_for(self) -> float:
        """Seconds since anything arrived from the peer."""
        if self._keepalive is None:
            return 0.0
        return self._loop.time() - self._keepalive.last_rx

    def add_close_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once when the connection ends (None: closed by us)."""
        if self.closed:
            self._loop.call_soon(callback, None if self._closed_locally else self._error)
        else:
            self._callbacks.append(callback)

    async def send(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Send one message on ``channel``; waits while the socket is backed up.

        The whole frame is handed to the socket layer before the first wait, so frames of
        concurrent senders never interleave.
        """
        self.send_nowait(channel, payload, meta=meta, seq=seq)
        if self._write_paused:
            await self._drain()

    def send_nowait(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Queue one message without waiting for the socket (for small control messages)."""
        self._check_open()
        try:
            mv = memoryview(payload)
            if mv.ndim != 1 or mv.itemsize != 1:
                mv = mv.cast("B")
        except TypeError as exc:
            raise UsageError(f"payload must be a C-contiguous bytes-like object: {exc}") from None
        n = mv.nbytes
        try:
            header = encode_header(FrameKind.DATA, channel, seq, meta, n, limits=self._cfg.limits)
        except ValueError as exc:
            raise UsageError(f"{self.label}: {exc}") from None
        t = self._transport
        assert t is not None
        if n <= _SMALL_WRITE:
            t.write(header + mv.tobytes() if n else header)
        else:
            t.write(header)
            # Python 3.12+ queues a reference to a buffer it could not send at once, so
            # the caller could change bytes "already sent"; copy there. 3.11 copies itself.
            t.write(mv if _WRITE_COPIES else mv.tobytes())
        self._stats.frames_sent += 1
        self._stats.bytes_sent += n + len(header)
        if self._keepalive is not None:
            self._keepalive.on_send(self._loop.time())

    async def recv(self, channel: int, *, timeout: float | None = None) -> Frame:
        """The next message on ``channel``."""
        if self._closed_locally:
            raise ConnectionClosedError(f"connection to {self.label} was closed locally")
        return await self._mailbox.get(channel, timeout)

    def retire(self, channel: int) -> None:
        """Drop queued and future frames of ``channel``."""
        self._mailbox.retire(channel)

    def interrupt(self, error: BaseException) -> None:
        """Fail current and future receives and send waits with ``error``.

        The connection stays open, so small control messages can still be sent.
        """
        if self._interrupted is None:
            self._interrupted = error
        self._mailbox.fail(error)
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def close(self) -> None:
        """Say goodbye and close; waits (briefly, bounded) for the socket to flush."""
        if self._closed_locally:
            return
        self._closed_locally = True
        t = self._transport
        if t is not None and self._error is None and not self._handshaking:
            with contextlib.suppress(Exception):
                t.write(_GOODBYE)
        self._finish(ConnectionClosedError(f"connection to {self.label} was closed locally"))
        if t is not None:
            t.close()
            try:
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self._lost)
            except TimeoutError:
                t.abort()

    def abort(self, error: BaseException) -> None:
        """Drop the connection at once, failing everyone waiting with ``error``."""
        self._finish(error)
        if self._transport is not None:
            self._transport.abort()

    # ---- asyncio protocol callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        first = self._transport is None
        self._transport = transport
        transport.set_write_buffer_limits(high=self._cfg.write_buffer_high)
        if first:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._server_side:
                self._owner._on_incoming(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._handshaking:
            return memoryview(self._hs_buf)
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._handshaking:
            self._hs_reader.feed(memoryview(self._hs_buf)[:nbytes])
            if len(self._hs_reader) > _HANDSHAKE_BUFFER_PAUSE and self._transport is not None:
                self._transport.pause_reading()
            self._wake_handshake()
            return
        if self._error is not None:
            return
        try:
            frames = self._decoder.buffer_updated(nbytes)
            if frames:
                self._on_frames(frames)
                return
        except FrameError as exc:
            if exc.frames:
                self._on_frames(exc.frames)
            self._protocol_error(str(exc))
            return
        except Exception as exc:  # nothing may escape the receive path
            log.exception("%s: error while receiving", self.label)
            self._protocol_error(f"could not process received data: {exc!r}")
            return
        if self._keepalive is not None:
            self._keepalive.on_receive(self._loop.time())

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        err: PeerError
        if self._goodbye_received and exc is None:
            err = ConnectionBrokenError(self.label, "closed its connection (left)", graceful=True)
        elif self._decoder.mid_frame and exc is None:
            err = RemoteProtocolError(self.label, "connection ended in the middle of a frame")
        else:
            why = f": {exc}" if exc else ""
            err = ConnectionBrokenError(self.label, f"connection lost{why}")
        self._finish(err)
        self._wake_handshake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    # ---- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed_locally:
            raise ConnectionClosedError(f"connection to {self.label} was closed locally")
        if self._error is not None:
            raise self._error.with_traceback(None)
        if self._handshaking:
            raise UsageError(f"connection to {self.label} is still handshaking")

    async def _drain(self) -> None:
        while self._write_paused:
            self._check_open()
            if self._interrupted is not None:
                raise self._interrupted
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = self._loop.create_future()
            await self._drain_waiter
        self._check_open()

    def _pause_reading(self) -> None:
        if self._keepalive is not None:
            self._keepalive.set_rx_paused(True, self._loop.time())
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._keepalive is not None:
            self._keepalive.set_rx_paused(False, self._loop.time())
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _finish(self, error: BaseException) -> None:
        """Record the end of the connection once and tell everyone waiting."""
        if self._error is not None:
            return
        self._error = error
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        self._mailbox.fail(error)
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)
        report = None if self._closed_locally else error
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(report)
            except Exception:
                log.exception("%s: close callback failed", self.label)
        self._owner._forget(self)

    def _protocol_error(self, message: str) -> None:
        err = RemoteProtocolError(self.label, message)
        log.warning("%s", err)
        self.abort(err)

    def _on_frames(self, frames: list[Frame]) -> None:
        now = self._loop.time()
        if self._keepalive is not None:
            self._keepalive.on_receive(now)
        for f in frames:
            self._stats.frames_received += 1
            self._stats.bytes_received += f.nbytes
            if f.kind is FrameKind.DATA:
                self._mailbox.deliver(f)
            elif f.kind is FrameKind.PING:
                if self._transport is not None and not self._transport.is_closing():
                    self._transport.write(_PONG)
            elif f.kind is FrameKind.PONG:
                if self._ping_sent_at is not None:
                    self._stats.rtt = now - self._ping_sent_at
                    self._ping_sent_at = None
            elif f.kind is FrameKind.GOODBYE:
                self._goodbye_received = True

    def _arm_keepalive(self) -> None:
        if self._keepalive is None or self._error is not None:
            return
        self._ka_timer = self._loop.call_at(
            self._keepalive.next_deadline() + 0.001, self._on_keepalive_timer
        )

    def _on_keepalive_timer(self) -> None:
        ka = self._keepalive
        if ka is None or self.closed:
            return
        now = self._loop.time()
        action = ka.poll(now)
        if action is KeepaliveAction.DEAD:
            self.abort(
                ConnectionBrokenError(
                    self.label, f"silent for {now - ka.last_rx:.1f} s (keepalive timeout)"
                )
            )
            return
        if action is KeepaliveAction.PING and self._transport is not None:
            self._transport.write(_PING)
            ka.on_send(now)
            if self._ping_sent_at is None:
                self._ping_sent_at = now
        self._arm_keepalive()

    # ---- handshake ---------------------------------------------------------------------

    def _wake_handshake(self) -> None:
        w, self._hs_wakeup = self._hs_wakeup, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _next_record(self) -> dict[str, Any]:
        while True:
            try:
                rec = self._hs_reader.next_record()
            except HandshakeError as exc:
                raise RemoteProtocolError(self.label, str(exc)) from None
            if rec is not None:
                return rec
            if self._error is not None:
                raise self._error.with_traceback(None)
            self._hs_wakeup = self._loop.create_future()
            await self._hs_wakeup

    def _write(self, data: bytes) -> None:
        assert self._transport is not None
        self._transport.write(data)

    async def _start_tls(self, ctx: ssl.SSLContext) -> None:
        assert self._transport is not None
        if len(self._hs_reader):
            raise RemoteProtocolError(self.label, "unexpected bytes before the TLS handshake")
        try:
            new = await self._loop.start_tls(
                self._transport,
                self,
                ctx,
                server_side=self._server_side,
                ssl_handshake_timeout=self._cfg.handshake_timeout,
            )
        except ssl.SSLError as exc:
            raise PeerAuthenticationError(self.label, f"TLS handshake failed: {exc}") from None
        except OSError as exc:  # reset or closed mid-handshake: a network failure
            raise ConnectionBrokenError(self.label, f"lost during TLS handshake: {exc}") from None
        if new is None:
            raise ConnectionBrokenError(self.label, "connection lost during TLS handshake")
        assert isinstance(new, asyncio.Transport)
        self._transport = new
        sslobj = new.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
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
                f"identity mismatch: expected {self._peer}, presented {presented}",
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
                self.label, f"identity mismatch: expected {expected}, presented {presented}"
            )
        if self._cfg.tls:
            await self._start_tls(owner.tls_identity.client_context())
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
        self.label = owner.label_for(client)
        mode = rec.get("mode")
        my_mode = "tls" if self._cfg.tls else "plain"
        refusal = None
        if mode != my_mode:
            refusal = f"this endpoint runs {my_mode!r}, the dialer asked for {mode!r}"
        elif want != bytes(owner.endpoint_id):
            wanted = base64.b32encode(want).decode().rstrip("=").lower()
            refusal = f"identity mismatch: expected {wanted}, presented {owner.endpoint_id}"
        elif not owner.accepts(client):
            refusal = f"endpoint {client} is not allowed to connect here"
        cert = rec.get("cert")
        if refusal is None and my_mode == "tls":
            try:
                if not isinstance(cert, bytes) or endpoint_id_of_cert(cert) != client:
                    refusal = "certificate key does not match the claimed endpoint id"
            except ValueError:
                refusal = "certificate is not an Ed25519 certificate"
        if refusal is not None:
            self._write(encode_record({"ok": False, "error": refusal}))
            raise PeerAuthenticationError(self.label, f"refused: {refusal}")
        nonce = secrets.token_bytes(32)
        self._write(encode_record({"ok": True, "id": bytes(owner.endpoint_id), "nonce": nonce}))
        if my_mode == "tls":
            assert isinstance(cert, bytes)
            await self._start_tls(owner.tls_identity.server_context(cert))
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
        self._enter_frames()

    def _enter_frames(self) -> None:
        leftover = self._hs_reader.leftover()
        self._handshaking = False
        self._hs_buf = bytearray()
        now = self._loop.time()
        self._keepalive = Keepalive.start(self._cfg.keepalive_interval, self._cfg.idle_timeout, now)
        if self._transport is not None:
            self._transport.resume_reading()
        if leftover:
            try:
                frames = self._decoder.feed(leftover)
            except FrameError as exc:
                if exc.frames:
                    self._on_frames(exc.frames)
                self._protocol_error(str(exc))
                return
            self._on_frames(frames)
        self._arm_keepalive()


class TcpTransport:
    """Authenticated TCP transport (TLS 1.3 unless ``config.tls`` is False)."""

    def __init__(
        self,
        key: SecretKey,
        config: TransportConfig | None = None,
        *,
        accept_from: Callable[[EndpointId], bool] | None = None,
        label_for: Callable[[EndpointId], str] | None = None,
    ) -> None:
        self.key = key
        self.config = config or TransportConfig()
        self._accept_from = accept_from
        self._label_for = label_for
        self._tls: TlsIdentity | None = None
        self._server: asyncio.Server | None = None
        self._accepted: asyncio.Queue[TcpConnection | None] = asyncio.Queue()  # None: closed
        self._connections: set[TcpConnection] = set()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def endpoint_id(self) -> EndpointId:
        """Our endpoint id."""
        return self.key.endpoint_id

    @property
    def tls_identity(self) -> TlsIdentity:
        """Our certificate and SSL contexts (made on first use)."""
        if self._tls is None:
            self._tls = TlsIdentity(self.key)
        return self._tls

    def label_for(self, peer: EndpointId) -> str:
        """How to name ``peer`` in errors."""
        return self._label_for(peer) if self._label_for else f"peer {peer.short()}"

    def accepts(self, peer: EndpointId) -> bool:
        """Whether ``peer`` may connect to us."""
        return self._accept_from is None or self._accept_from(peer)

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Start accepting connections; returns the bound (host, port)."""
        if self._closed:
            raise ConnectionClosedError("transport is closed")
        if self._server is not None:
            raise UsageError("already listening")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: TcpConnection(self, server_side=True), host, port, reuse_address=True
        )
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def connect(
        self, peer: EndpointId, address: Address, *, label: str | None = None
    ) -> TcpConnection:
        """Dial ``address`` and authenticate the other end as ``peer``."""
        if self._closed:
            raise ConnectionClosedError("transport is closed")
        host, port = parse_address(address)
        name = label or self.label_for(peer)
        loop = asyncio.get_running_loop()
        conn: TcpConnection | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                _, proto = await loop.create_connection(
                    lambda: TcpConnection(self, server_side=False, expected=peer), host, port
                )
                conn = proto
                conn.label = name
                self._connections.add(conn)
                await conn.client_handshake()
        except TimeoutError:
            if conn is not None:
                conn.abort(PeerTimeoutError(name, "handshake timed out"))
            raise PeerTimeoutError(
                name, f"handshake with {host}:{port} took over {self.config.handshake_timeout} s"
            ) from None
        except OSError as exc:
            err = ConnectionBrokenError(name, f"cannot connect to {host}:{port}: {exc}")
            if conn is not None:
                conn.abort(err)
            raise err from None
        except BaseException as exc:
            if conn is not None:
                conn.abort(exc if isinstance(exc, P2PError) else ConnectionClosedError("cancelled"))
            raise
        return conn

    async def accept(self, *, timeout: float | None = None) -> TcpConnection:
        """The next authenticated incoming connection."""
        if self._closed:
            raise ConnectionClosedError("transport is closed")
        try:
            async with asyncio.timeout(timeout):
                conn = await self._accepted.get()
        except TimeoutError:
            raise P2PTimeoutError(f"no incoming connection within {timeout} s") from None
        if conn is None:
            self._accepted.put_nowait(None)  # wake the next waiter too
            raise ConnectionClosedError("transport is closed")
        return conn

    def _on_incoming(self, conn: TcpConnection) -> None:
        if self._closed:
            conn.abort(ConnectionClosedError("transport is closed"))
            return
        self._connections.add(conn)
        task = asyncio.get_running_loop().create_task(self._serve_handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _serve_handshake(self, conn: TcpConnection) -> None:
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                await conn.server_handshake()
        except TimeoutError:
            conn.abort(PeerTimeoutError(conn.label, "handshake timed out"))
            log.warning("%s: incoming handshake timed out", conn.label)
            return
        except P2PError as exc:
            conn.abort(exc)
            log.warning("refused incoming connection: %s", exc)
            return
        except Exception as exc:  # never leave a half-open socket behind
            log.exception("%s: incoming handshake failed", conn.label)
            conn.abort(RemoteProtocolError(conn.label, f"handshake failed: {exc!r}"))
            return
        if self._closed:
            conn.abort(ConnectionClosedError("transport is closed"))
            return
        self._accepted.put_nowait(conn)

    def _forget(self, conn: TcpConnection) -> None:
        self._connections.discard(conn)

    async def close(self) -> None:
        """Stop listening and close every connection (bounded)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        handshakes = list(self._handshakes)
        for task in handshakes:
            task.cancel()
        if handshakes:
            await asyncio.wait(handshakes, timeout=2.0)
        conns = list(self._connections)
        while not self._accepted.empty():
            c = self._accepted.get_nowait()
            if c is not None:
                conns.append(c)
        if conns:
            await asyncio.gather(*(c.close() for c in set(conns)), return_exceptions=True)
        self._accepted.put_nowait(None)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
