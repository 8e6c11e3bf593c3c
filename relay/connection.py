"""One client connection of the relay server: :class:`_ClientConnection`, the asyncio
protocol on top of each accepted connection's stream, which feeds the core
(:class:`relay.state.RelayCore`) and implements its Link (:class:`relay.session.Link`).
:class:`relay.server.RelayServer` makes one per connection and owns the buffers, the
socket count and the sets of connections it uses.

Every connection is a :class:`~p2pdist.transport.securestream.SecureStream` (TLS, then
AES-GCM records once the client's upgrade offers them) with a :class:`_ClientConnection`
on top. Received bytes are handled in place: ciphertext lands in one buffer the server
owns (each stream copies it at once into its TLS memory BIO or record buffer, which is
released when drained), and every :class:`_ClientConnection` hands out one plaintext
scratch buffer too: the stream decrypts into it and calls ``buffer_updated`` right
away, on the one event loop thread, and the core is done with those bytes when that
call returns (it copies what it keeps). So an idle client holds no receive buffer of
its own. (A connection that is closing reads into a buffer of its own, so that a read
nested in another connection's could never overwrite the bytes being parsed.)

Each connection is seen from TCP up: a session is opened in the core as soon as TCP is
up (phase TLS), so connections still in their TLS handshake count against the caps on
connections waiting to authenticate (total and per source) and are evicted or refused
by the same rule; the server aborts connections still in their TLS handshake when it
shuts down (one that finished its handshake later would otherwise be served by a core
that no longer ticks); and :meth:`_ClientConnection.buffered` is the TCP transport's
write buffer, where everything queued towards a client waits, so ``queue_bytes`` bounds
it all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

from p2pdist.transport.aeadpipe import RecordError
from p2pdist.transport.securestream import SMALL_READ, SecureStream
from p2pdist.wire.relay import RECORDS_INFO, RECORDS_MAX

from .logfmt import kv
from .session import Phase, Session

if TYPE_CHECKING:
    from .server import RelayServer

__all__ = ["_ClientConnection"]

log = logging.getLogger("relay.server")
"""The server's logger (receive_failed, records_refused): one name for the asyncio glue."""

CLOSE_FLUSH_MAX = 64 * 1024
"""Bytes still queued towards a client beyond which the relay's close gives it only
:data:`CLOSE_BUSY_GRACE` to flush, not the whole close grace (see
:meth:`_ClientConnection.close`)."""
CLOSE_BUSY_GRACE = 0.5
"""Seconds a closed connection with over :data:`CLOSE_FLUSH_MAX` queued may flush."""
NESTED_READ = 16 * 1024
"""Least size of the private receive buffer of a connection that is closing (its last
reads may come while another connection's read is being handled)."""


class _ClientConnection(asyncio.BufferedProtocol):
    """One accepted connection, on top of its :class:`SecureStream`: feeds the core and
    implements its Link."""

    def __init__(self, server: RelayServer, *, proxied: bool = False) -> None:
        self.stream: SecureStream | None = None
        """Set by the factory right after it makes both (None on the plain HTTP port)."""
        self._proxied = proxied
        self._server = server
        self._core = server.core
        self._loop = asyncio.get_running_loop()
        self._tap = server.tap
        self._buffer: bytearray | None = None
        self._transport: asyncio.Transport | None = None
        self._raw: asyncio.Transport | None = None
        self._session: Session | None = None
        self._abort: asyncio.TimerHandle | None = None
        self._resume: asyncio.TimerHandle | None = None
        """Set while reading is paused for the client's rate (see :meth:`pause`)."""
        self._records_seen = 0
        """The stream's ``records_in`` at the last read handed to the core."""
        self._reads_seen = 0
        """The stream's ``small_reads_in`` then (socket reads under ``SMALL_READ``
        bytes, which may hold a byte of a record)."""
        self._wire_seen = 0
        """The stream's ``bytes_in`` then (what the client sent, as ciphertext)."""
        self._counted = False
        """Whether this connection holds one of the server's socket slots."""

    def _peer(self, transport: asyncio.BaseTransport) -> tuple[str, int]:
        peer = transport.get_extra_info("peername") or ("?", 0)
        return str(peer[0]), int(peer[1])

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._server.release_socket()

    # ---- SecureStream's hooks for the TCP connection underneath ------------------------

    def raw_connection_made(self, transport: asyncio.Transport) -> None:
        """TCP is up, the TLS handshake starts: the session is opened now, so the
        handshake counts against the caps on waiting connections."""
        self._raw = transport
        if self._server.closing or not self._server.take_socket(self._peer(transport)[0]):
            transport.abort()
            return
        self._counted = True
        self._server.handshaking.add(self)
        self._session = self._core.open(
            self, self._peer(transport), self._loop.time(), handshaking=True
        )  # refused: closed (aborted) already

    def raw_connection_lost(self) -> None:
        """TCP is gone, the handshake done or not."""
        self._server.handshaking.discard(self)
        self._release()
        if self._transport is None and self._session is not None:
            # The handshake never completed: no connection_lost will follow. Say why
            # (an operator's plain-HTTP health check on the TLS port, say).
            failure = self.stream.failure if self.stream is not None else None
            why = None if failure is None else str(failure)
            self._core.lost(self._session, self._loop.time(), why)

    def abort_handshake(self) -> None:
        """Drop the TCP connection of a handshake that has not completed."""
        if self._raw is not None and self._transport is None:
            self._raw.abort()

    # ---- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server.handshaking.discard(self)
        self._server.connections.add(self)
        now = self._loop.time()
        if self._session is not None:  # opened when TCP came up
            self._core.handshake_done(self._session, now)
            if self._session.phase is Phase.CLOSED:  # pragma: no cover - aborted before
                self.abort()
            return
        if self._raw is None:  # the plain HTTP port (no TLS underneath): count it now
            if not self._server.take_socket():
                self.abort()
                return
            self._counted = True  # (accepted as a shutdown began: the core answers 503)
        self._session = self._core.open(self, self._peer(transport), now, proxied=self._proxied)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._transport is not None and self._transport.is_closing():
            # May be nested in another connection's receive: see the module doc.
            self._buffer = bytearray(max(sizehint, NESTED_READ))
        else:
            self._buffer = self._server.scratch
            session = self._session
            if session is not None:
                return memoryview(self._buffer)[
                    : self._core.read_allowance(session, self._loop.time())
                ]
        return memoryview(self._buffer)

    def buffer_updated(self, nbytes: int) -> None:
        buffer, self._buffer = self._buffer, None
        if self._session is None or buffer is None:
            return
        try:
            with memoryview(buffer) as whole, whole[:nbytes] as data:
                if self._tap is not None:
                    self._tap(self._session.conn_id, "in", bytes(data))
                # (without a stream, this is the socket read)
                records, reads, wire = 0, int(nbytes < SMALL_READ), None
                if self.stream is not None:
                    seen, self._records_seen = self._records_seen, self.stream.records_in
                    records = self._records_seen - seen
                    seen, self._reads_seen = self._reads_seen, self.stream.small_reads_in
                    reads = self._reads_seen - seen
                    seen, self._wire_seen = self._wire_seen, self.stream.bytes_in
                    wire = self._wire_seen - seen
                self._core.receive(
                    self._session, data, self._loop.time(), records, reads, wire_bytes=wire
                )
        except Exception:  # pragma: no cover - a bug costs this connection, not the relay
            log.exception(kv("receive_failed", conn=self._session.label))
            self.abort()

    def eof_received(self) -> bool | None:
        """The client half-closed (close_notify or FIN): it is gone for routing now, and
        our side closes too, aborted after the close grace if bytes stay stuck."""
        if self._session is not None:
            self._core.eof(self._session, self._loop.time())
        self._arm_abort()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        dropped = self.stream.dropped_for if self.stream is not None else None
        if dropped is not None:
            label = self._session.label if self._session is not None else "?"
            self._server.client_dropped(dropped[0], label, dropped[1])
        self._release()
        if self._abort is not None:
            self._abort.cancel()
            self._abort = None
        if self._session is not None:
            failure = self.stream.failure if self.stream is not None else None
            why = exc or failure
            self._core.lost(self._session, self._loop.time(), None if why is None else str(why))
            if self._server._own_tap is not None:
                self._server._own_tap.forget(self._session.conn_id)
        self._server.connection_gone(self)

    # ---- Link -------------------------------------------------------------------------

    def write(self, data: bytearray) -> None:
        """Queue ``data`` on the TLS transport (which may keep it: it is ours no more)."""
        if self._transport is None or self._transport.is_closing():
            return
        if self._tap is not None and self._session is not None:
            self._tap(self._session.conn_id, "out", bytes(data))
        self._transport.write(data)

    def buffered(self) -> int:
        """Bytes not yet handed to the kernel (encrypted as they are written, so all of
        them wait in the TCP transport)."""
        transport = self._raw if self._raw is not None else self._transport
        return 0 if transport is None else transport.get_write_buffer_size()

    def secure(self, records: tuple[bytes, bytes] | None) -> None:
        """TLS or records for the rest of the connection (see :class:`relay.session.Link`)."""
        stream = self.stream
        if stream is None:  # the plain HTTP port: the core never takes records there
            return
        if records is None:
            stream.keep_tls()
            return
        mine, theirs = records
        try:
            stream.start_records(
                mine, theirs, dialer=False, info=RECORDS_INFO, max_record=RECORDS_MAX
            )
        except RecordError as exc:
            label = self._session.label if self._session is not None else "?"
            log.info(kv("records_refused", conn=label, why=str(exc)))
            self.abort()

    def pause(self, seconds: float) -> None:
        """Read nothing from the client for ``seconds`` (see :class:`relay.session.Link`)."""
        transport = self._transport
        if self._resume is not None or transport is None or transport.is_closing():
            return
        transport.pause_reading()
        self._resume = self._loop.call_later(seconds, self._resume_reading)

    def _resume_reading(self) -> None:
        self._resume = None
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def close(self) -> None:
        """Flush and close; abort if the peer does not take the bytes within the close
        grace (:data:`CLOSE_GRACE`, ``drain_timeout`` once the server is shutting down).
        Still in the TLS handshake: abort now (there is nothing to flush)."""
        if self._transport is None:
            self.abort_handshake()
            return
        grace = None
        if not self._transport.is_closing():
            if self.buffered() > CLOSE_FLUSH_MAX and not self._server.closing:
                # A client with this much still waiting is most likely not reading (it
                # was replaced, went silent, or broke the protocol): its queue would be
                # held for the grace outside every cap, and a client reconnecting again
                # and again could park memory that way. One that reads still gets its
                # ERROR within the short grace. (A shutdown drains as it can.)
                grace = CLOSE_BUSY_GRACE
            self._transport.close()
        self._arm_abort(grace)

    def _arm_abort(self, grace: float | None = None) -> None:
        if self._abort is None and self._transport is not None:
            wait = self._server.close_grace if grace is None else grace
            self._abort = self._loop.call_later(wait, self.abort)

    def abort(self) -> None:
        """Drop the connection now."""
        if self._transport is not None:
            self._transport.abort()
        if self._raw is not None:
            self._raw.abort()  # a no-op unless TLS had let go of it
