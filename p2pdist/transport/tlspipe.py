"""TLS over memory BIOs for a buffered asyncio protocol (sans-I/O).

:class:`TlsPipe` wraps one ``ssl.SSLObject`` (the ``ssl`` module's own TLS, through
``SSLContext.wrap_bio``): ciphertext from the socket goes in with :meth:`TlsPipe.feed`,
plaintext comes out straight into the caller's buffer (:meth:`TlsPipe.read_into`, so a
payload still lands in its own buffer), and :meth:`TlsPipe.encrypt` turns plaintext into
the bytes for the socket. It does no I/O and keeps no timers: the connection moves the
bytes and bounds the handshake.

Why not ``loop.start_tls``: asyncio's TLS layer (``sslproto``) runs the same
``SSLObject`` calls under a general state machine (flow control, write backlog, app
buffer bookkeeping) that costs more Python per record than the TLS itself for small
messages; the connection already has its own flow control and frame decoder.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import cast

__all__ = ["TLS_BACKLOG", "TlsPipe"]

TLS_BACKLOG = 4 << 20
"""The most TLS may queue by itself towards a peer that reads nothing (answers to its key
update requests): a relay's default ``backlog_limit`` (SecureStream), and what a TCP
connection allows above its ``write_buffer_high``."""

_READ = 256 * 1024
"""Bytes read from the socket at a time once frames flow."""
_STUCK = 2 * (16 * 1024 + 256 + 5)
"""Two records of the largest kind TLS 1.3 sends."""


class TlsPipe:
    """One TLS session over memory BIOs (see the module docstring)."""

    __slots__ = (
        "_cipher",
        "_failed",
        "_in",
        "_out",
        "closed_by_peer",
        "handshake_done",
        "obj",
        "records_in",
    )

    def __init__(
        self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None
    ) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._cipher = memoryview(b"")
        """Where the socket's ciphertext lands (allocated on the first get_buffer)."""
        self.obj = context.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        """The ``ssl.SSLObject`` (version, peer certificate)."""
        self.handshake_done = False
        self.closed_by_peer = False
        """The peer sent close_notify: no more data will come."""
        self.records_in = 0
        """TLS reads that returned data (about one per record: a record read in pieces
        counts once per piece)."""
        self._failed: ssl.SSLError | None = None
        """An error :meth:`fill` holds back until the records before it are handed out."""

    @property
    def buffered(self) -> int:
        """Ciphertext received and not yet decrypted."""
        return self._in.pending

    @property
    def readable(self) -> bool:
        """Whether :meth:`read_into` may have something: ciphertext not yet decrypted,
        or plaintext of a record decrypted only in part (or an error :meth:`fill` held
        back)."""
        return self._in.pending > 0 or self.obj.pending() > 0 or self._failed is not None

    @property
    def stuck(self) -> bool:
        """Whether more ciphertext waits than a whole record could hold: what is there
        cannot be decrypted (reading is not paused when this is asked)."""
        return self._in.pending > _STUCK

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Ciphertext received from the socket."""
        self._in.write(data)

    def get_buffer(self) -> memoryview:
        """Where the next ciphertext from the socket may land (then :meth:`buffer_updated`)."""
        if not self._cipher:
            self._cipher = memoryview(bytearray(_READ))
        return self._cipher

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` of ciphertext were written into :meth:`get_buffer`'s buffer."""
        self._in.write(self._cipher[:nbytes])

    def take_buffered(self) -> bytes:
        """Remove and return the ciphertext not yet decrypted (what follows the last
        record read, for :class:`~p2pdist.transport.aeadpipe.AeadPipe`)."""
        return self._in.read()

    def outgoing(self) -> bytes:
        """Ciphertext to send (handshake messages, alerts, close_notify); b"" if none."""
        return self._out.read() if self._out.pending else b""

    def handshake(self) -> bool:
        """Advance the handshake with what was fed: True once it is complete. Raises
        ``ssl.SSLError`` when it fails (:meth:`outgoing` then holds the alert)."""
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            return False
        self.handshake_done = True
        return True

    def read_into(self, buf: memoryview) -> int:
        """Decrypt into ``buf`` (non-empty; at most one TLS record's worth): the number of
        bytes written, 0 when no whole record is buffered or the peer has closed TLS
        (:attr:`closed_by_peer`). Raises ``ssl.SSLError`` for a corrupt stream."""
        try:
            # With a buffer, read() returns a count (typeshed says bytes).
            n = cast(int, self.obj.read(len(buf), buf))
        except ssl.SSLWantReadError:
            return 0
        except ssl.SSLZeroReturnError:
            self.closed_by_peer = True
            return 0
        if not n:  # close_notify: ssl returns 0 (and raises only once ours went too)
            self.closed_by_peer = True
        else:
            self.records_in += 1
        return n

    def fill(self, buf: memoryview) -> int:
        """Decrypt into ``buf`` (non-empty) until it is full or no whole record is left:
        the bytes written. Raises ``ssl.SSLError`` for a corrupt stream, but only once
        what was decrypted before it was handed out (on the next call when this one
        wrote some)."""
        if self._failed is not None:
            raise self._failed
        n = 0
        while n < buf.nbytes and (self._in.pending or self.obj.pending()):
            try:
                got = self.read_into(buf[n:])
            except ssl.SSLError as exc:
                if not n:
                    raise
                self._failed = exc
                break
            if not got:
                break
            n += got
        return n

    def encrypt(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The ciphertext of ``parts`` (one TLS record or more each, and anything else
        pending), for one socket write."""
        for data in parts:
            self.obj.write(data)
        return self._out.read()

    def close_notify(self) -> bytes:
        """Start closing TLS: the close_notify alert to send (b"" if it cannot go)."""
        # SSLWantReadError: the peer's close_notify, which is not awaited
        with contextlib.suppress(ssl.SSLError):
            self.obj.unwrap()
        return self.outgoing()
