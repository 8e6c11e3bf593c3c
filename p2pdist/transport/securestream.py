"""TLS, then optionally AES-GCM records, under a buffered asyncio protocol.

The relay's connections, on both ends, run through :class:`SecureStream`: it is the
protocol the TCP transport talks to, and the app protocol on top (an
``asyncio.BufferedProtocol``) sees plaintext through a :class:`SecureTransport`, as it
would under ``create_connection(ssl=...)``. TLS runs on :class:`~.tlspipe.TlsPipe`; once
both ends have agreed, in TLS, on a secret each, the app calls
:meth:`SecureStream.start_records` and every byte after that moves in
:class:`~.aeadpipe.AeadPipe` records instead (the relay protocol's upgrade says when:
docs/protocol.md 8.2). Why: the records' AES-GCM (``cryptography``) runs at several
times the speed of the system OpenSSL under Python's ``ssl``, and a record carries a
whole batch of frames where a TLS record carries 16 KiB.

Until the app has decided (:meth:`SecureStream.start_records` or
:meth:`SecureStream.keep_tls`), TLS is read one record at a time, so that the bytes
after the record that carried the agreement are handed to the records unread.

Memory: a server passes one ciphertext landing buffer for all its connections
(``scratch``); each connection then copies what it keeps (TLS into its memory BIO,
records into a record buffer that is released whenever it is drained), so an idle
connection holds no receive buffer; once records carry the data the TLS session is let
go too. A client's connection reads into buffers of its own: 256 KiB for TLS, then the
record buffer, which may grow to ``read_size`` (1 MiB for the relay client) while
reads fill it, so that a busy receiver drains its socket in few reads.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, cast

from .aeadpipe import CIPHER, RECEIVE_BUFFER, AeadPipe, RecordError
from .tcp import _write_keeps_reference
from .tlspipe import TLS_BACKLOG, TlsPipe

__all__ = ["SecureStream", "SecureTransport"]

_OWN_READ = 256 * 1024
"""Ciphertext read at a time by a connection without a shared landing buffer."""
SMALL_READ = 1024
"""Socket reads shorter than this are counted (``small_reads_in``) and may be limited
(``small_reads_per_record``): a full-size TCP segment is longer."""


class SecureTransport(asyncio.Transport):
    """What the app protocol of a :class:`SecureStream` writes to (plaintext in)."""

    def __init__(self, stream: SecureStream) -> None:
        super().__init__()
        self._stream = stream

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` and queue it on the TCP transport (never blocks)."""
        self._stream.write(data)

    def is_closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._stream.is_closing()

    def close(self) -> None:
        """Flush what is queued, then close (TLS sends close_notify first)."""
        self._stream.close()

    def abort(self) -> None:
        """Drop the connection now."""
        self._stream.abort()

    def get_write_buffer_size(self) -> int:
        """Ciphertext queued on the TCP transport, not yet handed to the kernel."""
        return self._stream.write_buffer_size()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``ssl_object`` (the TLS session; None once records carry the data, when it
        is let go), ``records`` (the record cipher, or None while TLS carries the data),
        else the TCP transport's."""
        return self._stream.extra_info(name, default)

    def pause_reading(self) -> None:
        """Stop handing plaintext to the app (and reading the socket)."""
        self._stream.set_reading(False)

    def resume_reading(self) -> None:
        """Start handing plaintext to the app again."""
        self._stream.set_reading(True)

    def is_reading(self) -> bool:
        """Whether plaintext is handed to the app as it comes."""
        return not self._stream.paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The TCP transport's write buffer limits."""
        self._stream.raw_transport().set_write_buffer_limits(high, low)


class SecureStream(asyncio.BufferedProtocol):
    """TLS and then, once agreed, AES-GCM records between the TCP transport and ``app``
    (see the module docstring). ``handshake`` resolves when TLS is up (or fails with
    the TLS error, or ``ConnectionError`` when the connection went first).
    ``read_size``: how far the record buffer of a connection with its own buffers (no
    ``scratch``) may grow while socket reads fill it, at least
    :data:`~.aeadpipe.RECEIVE_BUFFER`: a busy receiver then drains its socket in
    fewer, larger reads (TLS is read :data:`_OWN_READ` bytes at a time).
    ``backlog_limit``: the most ciphertext queued towards the peer once TLS has added
    its own answers (to key update requests): a peer that asks for key updates and
    reads nothing would otherwise grow the queue without end (each answer is a TLS
    record, written whether or not the peer reads); over it the stream fails.
    ``early_records``: the most TLS records read before the app decides (None: no
    limit). Until then each record is handed over on its own, so a peer sending one
    byte per record costs a whole pass through the app per byte; a real client needs
    one or two. ``small_reads_per_record``: the most socket reads shorter than
    :data:`SMALL_READ` in a row without a record completing (None: no limit): each is a
    pass of Python, and a peer sending its records a byte per TCP segment would
    otherwise cost that per byte, where a real one needs a few dozen reads for the
    largest record."""

    def __init__(
        self,
        app: asyncio.BufferedProtocol,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        handshake_timeout: float,
        server_hostname: str | None = None,
        scratch: memoryview | None = None,
        read_size: int = RECEIVE_BUFFER,
        backlog_limit: int = TLS_BACKLOG,
        early_records: int | None = None,
        small_reads_per_record: int | None = None,
    ) -> None:
        if read_size < RECEIVE_BUFFER:
            raise ValueError(f"read_size must be at least {RECEIVE_BUFFER}")
        self._backlog_limit = backlog_limit
        self._early_records = early_records
        self._small_reads_limit = small_reads_per_record
        self._small_run = 0
        """Small reads since a record last completed (see ``small_reads_per_record``)."""
        self._records_at_run = 0
        self._app = app
        self._context = context
        self._server_side = server_side
        self._server_hostname = server_hostname
        self._handshake_timeout = handshake_timeout
        self._shared = scratch is not None
        self._scratch = scratch if scratch is not None else memoryview(bytearray(_OWN_READ))
        self._read_size = read_size
        self._loop = asyncio.get_running_loop()
        self._raw: asyncio.Transport | None = None
        self._tls: TlsPipe | None = None
        self._tls_records = 0
        """TLS records read before records took over (the TLS pipe is let go then)."""
        self._records: AeadPipe | None = None
        self._decided = False
        """Whether the app chose records or TLS (until then TLS is read record by record)."""
        self._timer: asyncio.TimerHandle | None = None
        self._transport = SecureTransport(self)
        self._up = False
        """Whether the app was told connection_made (and so must hear connection_lost)."""
        self._closing = False
        self._eof_told = False
        """Whether the app heard eof_received (TLS close_notify or TCP FIN: once)."""
        self._draining = False
        self._copy_writes = False
        self.paused = False
        """Whether the app paused reading."""
        self.failure: Exception | None = None
        """What broke the stream (a TLS error, a record that did not decrypt), if it
        failed rather than closed."""
        self.small_reads_in = 0
        """Socket reads shorter than :data:`SMALL_READ` so far: each costs a pass of
        Python whatever it holds (one byte of a record, say), which the relay charges
        (``relay.state.READ_CHARGE``)."""
        self.bytes_in = 0
        """Bytes read from the socket so far (ciphertext: TLS's padding, empty records and
        key updates, which carry no plaintext, included)."""
        self.dropped_for: tuple[str, str] | None = None
        """(event, detail) when the stream dropped the peer for a limit of its own:
        ``client_not_reading`` (``backlog_limit``), ``early_records`` or ``small_reads``."""
        self.handshake: asyncio.Future[None] = self._loop.create_future()

    # ---- for the app and its transport --------------------------------------------------

    @property
    def records_in(self) -> int:
        """TLS and AES-GCM records read so far (about: see ``TlsPipe.records_in``)."""
        tls = self._tls.records_in if self._tls is not None else self._tls_records
        return tls + (self._records.records_in if self._records is not None else 0)

    @property
    def records(self) -> str | None:
        """The record cipher in use, or None while TLS carries the data."""
        return CIPHER if self._records is not None else None

    def start_records(
        self,
        send_secret: bytes,
        receive_secret: bytes,
        *,
        dialer: bool,
        info: bytes,
        max_record: int,
    ) -> None:
        """From the next byte on, in both directions, records keyed by these secrets
        (exchanged in TLS by the app) carry the data. Call it right after the last TLS
        data of both directions: the app has sent its last TLS bytes and has just been
        handed the peer's (TLS data the peer sent after them is an error).
        ``max_record``: the largest plaintext per record, both ways (a longer one
        received ends the connection). Raises :class:`~.aeadpipe.RecordError` (equal
        secrets, TLS data after the agreement)."""
        tls = self._tls
        if tls is None or not tls.handshake_done or self._records is not None or self._decided:
            raise RecordError("records can only start once, after the TLS handshake")
        if tls.obj.pending():
            raise RecordError("TLS data after the record keys")
        self._records = AeadPipe(
            send_secret,
            receive_secret,
            dialer=dialer,
            info=info,
            lean=self._shared,
            max_record=max_record,
            receive_buffer=self._read_size,
        )
        self._records.feed(tls.take_buffered())
        self._tls_records = tls.records_in
        self._tls = None  # a relay's largest cost per idle client (about 15 KiB)
        if not self._shared:
            self._scratch = memoryview(b"")  # reads land in the record buffer from now on
        self._decided = True
        if not self._draining:  # records that came with the agreement's TLS record
            self._loop.call_soon(self._drain)

    def keep_tls(self) -> None:
        """TLS carries the data for good (the peer does not do records)."""
        self._decided = True
        if not self._draining:
            self._loop.call_soon(self._drain)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` for the peer and queue it."""
        raw = self._raw
        if raw is None or self._closing or raw.is_closing() or not data:
            return
        if self._records is not None:
            raw.write(self._records.encrypt(data, fresh=self._copy_writes))
            return
        assert self._tls is not None
        try:
            raw.write(self._tls.encrypt(data))
        except ssl.SSLError as exc:
            self._fail(exc)

    def is_closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._closing or self._raw is None or self._raw.is_closing()

    def close(self) -> None:
        """Flush and close (TLS: close_notify first)."""
        if self._closing:
            return
        self._closing = True
        raw = self._raw
        if raw is None or raw.is_closing():
            return
        if self._records is None and self._tls is not None and self._tls.handshake_done:
            notify = self._tls.close_notify()
            if notify:
                raw.write(notify)
        raw.close()

    def abort(self) -> None:
        """Drop the connection now."""
        self._closing = True
        if self._raw is not None:
            self._raw.abort()

    def write_buffer_size(self) -> int:
        """Ciphertext not yet handed to the kernel."""
        return 0 if self._raw is None else self._raw.get_write_buffer_size()

    def extra_info(self, name: str, default: Any = None) -> Any:
        """See :meth:`SecureTransport.get_extra_info`."""
        if name == "ssl_object":
            return None if self._tls is None else self._tls.obj
        if name == "records":
            return self.records
        return default if self._raw is None else self._raw.get_extra_info(name, default)

    def raw_transport(self) -> asyncio.Transport:
        """The TCP transport underneath."""
        assert self._raw is not None
        return self._raw

    def set_reading(self, on: bool) -> None:
        """Pause or resume handing plaintext to the app (and reading the socket)."""
        self.paused = not on
        raw = self._raw
        if raw is not None and not raw.is_closing():
            if on:
                raw.resume_reading()
            else:
                raw.pause_reading()
        if on and not self._draining:
            self._loop.call_soon(self._drain)  # what came before the pause

    # ---- asyncio.BufferedProtocol (the TCP side) ----------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports do not subclass asyncio's classes.
        raw = self._raw = cast(asyncio.Transport, transport)
        self._copy_writes = _write_keeps_reference(raw)
        watch = getattr(self._app, "raw_connection_made", None)
        if watch is not None:
            watch(raw)
            if raw.is_closing():  # the app refused it
                return
        self._tls = TlsPipe(
            self._context, server_side=self._server_side, server_hostname=self._server_hostname
        )
        self._timer = self._loop.call_later(self._handshake_timeout, self._timed_out)
        self._advance_handshake()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._records is not None and not self._shared:
            return self._records.get_buffer()
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        if nbytes < SMALL_READ and not self._small_read_allowed():
            return
        if self._closing and not self._up:
            return
        records = self._records
        if records is not None:
            if self._shared:
                records.feed(self._scratch[:nbytes])
            else:
                records.buffer_updated(nbytes)
            self._drain()
            return
        tls = self._tls
        if tls is None:
            return
        tls.feed(self._scratch[:nbytes])
        if not tls.handshake_done:
            self._advance_handshake()
        else:
            self._drain()

    def eof_received(self) -> bool | None:
        if not self._up:
            return None
        # The TCP transport reads nothing while the app has paused reading (set_reading
        # pauses it too), so no plaintext can wait behind this end.
        self._drain()
        return self._tell_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._closing = True
        self._handshake_failed(
            ConnectionError(f"connection lost during the TLS handshake: {exc or 'closed'}")
        )
        if self._up:
            self._up = False
            self._app.connection_lost(exc)
        watch = getattr(self._app, "raw_connection_lost", None)
        if watch is not None:
            watch()

    def pause_writing(self) -> None:
        if self._up:
            self._app.pause_writing()

    def resume_writing(self) -> None:
        if self._up:
            self._app.resume_writing()

    # ---- internals ----------------------------------------------------------------------

    def _small_read_allowed(self) -> bool:
        """Count a small read; False (the stream failed) past ``small_reads_per_record``
        of them in a row without a record completing."""
        self.small_reads_in += 1
        limit = self._small_reads_limit
        if limit is None:
            return True
        records = self.records_in
        if records != self._records_at_run:
            self._records_at_run, self._small_run = records, 0
        self._small_run += 1
        if self._small_run <= limit:
            return True
        why = f"{self._small_run} reads under {SMALL_READ} bytes without a whole record"
        self.dropped_for = ("small_reads", why)
        self._fail(RecordError(why))
        return False

    def _flush_tls(self) -> bool:
        """Queue what TLS itself has to send; False (the stream failed) when that leaves
        more than ``backlog_limit`` bytes queued towards a peer that does not read."""
        tls, raw = self._tls, self._raw
        if tls is None or raw is None or raw.is_closing():
            return True
        out = tls.outgoing()
        if out:
            raw.write(out)
            queued = raw.get_write_buffer_size()
            if queued > self._backlog_limit:
                why = f"it reads nothing of what TLS must send it ({queued} bytes queued)"
                self.dropped_for = ("client_not_reading", why)
                self._fail(ConnectionError(why))
                return False
        return True

    def _advance_handshake(self) -> None:
        tls = self._tls
        assert tls is not None
        try:
            done = tls.handshake()
        except ssl.SSLError as exc:
            self._flush_tls()  # our alert: tells the peer why
            self._fail(exc)
            return
        if not self._flush_tls() or not done:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._up = True
        self._app.connection_made(self._transport)
        if not self.handshake.done():
            self.handshake.set_result(None)
        self._drain()  # app data that came with the handshake's last flight

    def _tell_eof(self) -> bool | None:
        """The app's answer to the end of the peer's data (asked once)."""
        if self._eof_told:
            return None
        self._eof_told = True
        return self._app.eof_received()

    def _timed_out(self) -> None:
        self._timer = None
        self._handshake_failed(
            TimeoutError(f"TLS handshake not done within {self._handshake_timeout:g} s")
        )
        self.abort()

    def _fail(self, exc: Exception) -> None:
        """The stream is broken (TLS error, a record that does not decrypt): drop it."""
        if self.failure is None:
            self.failure = exc
        self._handshake_failed(exc)
        self.abort()

    def _handshake_failed(self, exc: BaseException) -> None:
        """``handshake`` fails with ``exc`` unless it resolved already (marked as read:
        the app may not be waiting on it)."""
        if not self.handshake.done():
            self.handshake.set_exception(exc)
            self.handshake.exception()

    def _drain(self) -> None:
        """Hand the app every plaintext byte that is here, unless it paused reading."""
        if not self._up or self._draining:
            return
        self._draining = True
        try:
            while not self.paused and not (self._raw is None or self._raw.is_closing()):
                records = self._records
                buf = memoryview(self._app.get_buffer(-1))
                try:
                    if records is not None:
                        n = records.fill(buf)
                    else:
                        assert self._tls is not None
                        # One TLS record at a time until the app has decided: the
                        # bytes after the agreement must stay unread.
                        if self._decided:
                            n = self._tls.fill(buf)
                        else:
                            n = self._tls.read_into(buf)
                            limit = self._early_records
                            if limit is not None and self._tls.records_in > limit:
                                why = "too many TLS records before the upgrade"
                                self.dropped_for = ("early_records", why)
                                raise RecordError(why)
                        if not self._flush_tls():  # answers to what TLS read (key updates)
                            return
                except (ssl.SSLError, RecordError) as exc:
                    if records is None:
                        self._flush_tls()  # our alert: tells the peer why
                    self._fail(exc)
                    return
                if n:
                    self._app.buffer_updated(n)
                    continue
                # TLS close_notify: nothing more will come; end as on a TCP EOF.
                notified = records is None and self._tls is not None and self._tls.closed_by_peer
                if notified and not self._tell_eof() and self._raw is not None:
                    self._raw.close()
                break
        finally:
            self._draining = False
