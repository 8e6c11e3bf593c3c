"""AES-256-GCM records under keys agreed inside TLS (sans-I/O).

A TLS connection (:class:`~p2pdist.transport.tlspipe.TlsPipe`) authenticates both ends
and agrees the keys; the frames that follow travel in these records instead of TLS
records. Why: Python's ``ssl`` runs on the system's OpenSSL, whose AES-GCM here is about
a third as fast as the one ``cryptography`` bundles (4.2 against 13.5 GB/s on 1 MiB,
docs/performance.md), and a TLS record carries at most 16 KiB, so bulk frames cost one
Python call per 16 KiB instead of one per 1 MiB. QUIC does the same: TLS for the
handshake, its own packet protection for the data.

Wire format (each direction on its own)::

    record  = length:u32 (big-endian, ciphertext bytes incl. the 16-byte tag)
              ciphertext = AES-256-GCM(key_i, nonce, plaintext, aad=length bytes)
    nonce   = 4 zero bytes || record number within the key (u64, big-endian)

The sender picks a fresh random 32-byte secret per connection and sends it to the peer
inside TLS; ``key_0 = HKDF-SHA256(secret, info=INFO + " dialer" | " acceptor")`` (the
sending side's role: a record reflected back never decrypts, even under equal secrets,
which are refused anyway) and every :data:`REKEY_RECORDS` records both ends move to
``key_{i+1} = HKDF-Expand(key_i, UPDATE_INFO)``, with the record number back at 0. A
record that does not decrypt (altered, reordered, replayed, cut), or one longer than
:data:`MAX_RECORD` plus the tag, breaks the stream (:class:`RecordError`), and the
bytes it was decrypted into are zeroed (AES-GCM writes before it checks the tag).
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

__all__ = [
    "CIPHER",
    "MAX_RECORD",
    "RECEIVE_BUFFER",
    "REKEY_RECORDS",
    "AeadPipe",
    "RecordError",
    "new_secret",
]

CIPHER = "aes-256-gcm"
"""The record protection's name in the handshake."""
MAX_RECORD = 1 << 20
"""Largest plaintext one record may carry (a large payload is sent in records this big)."""
REKEY_RECORDS = 1 << 18
"""Records per key: at most 2^18 x 1 MiB = 256 GiB under one key (TLS 1.3 allows AES-GCM
about 2^24.5 records of 16 KiB, some 360 GiB)."""
TAG = 16
INFO = b"p2pdist tcp records v1 aes-256-gcm"
UPDATE_INFO = b"p2pdist tcp records v1 key update"
_LEN = struct.Struct(">I")
_NONCE = struct.Struct(">4xQ")
RECEIVE_BUFFER = 2 * (64 * 1024 + TAG + _LEN.size)
"""The receive buffer to start with (and the least ``receive_buffer``): two records of a
small frame. It doubles when a larger record does not fit (up to about twice
:data:`MAX_RECORD` for bulk traffic), so a connection that carries only small messages
keeps 128 KiB."""


_LEAN_OUT = 16 * 1024
"""A lean pipe keeps its send buffer only up to this size (a larger one is made per call)."""


class RecordError(Exception):
    """The record stream is broken (a record that does not decrypt, or a bad length)."""


def new_secret() -> bytes:
    """A fresh secret for one direction of one connection."""
    return os.urandom(32)


def _first_key(secret: bytes, info: bytes, label: bytes) -> bytes:
    info = info + b" " + label
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _next_key(key: bytes, update_info: bytes) -> bytes:
    return HKDFExpand(algorithm=hashes.SHA256(), length=32, info=update_info).derive(key)


class _Direction:
    """One direction's key schedule: the key in use and the next record number."""

    __slots__ = ("aead", "key", "seq", "update_info")

    def __init__(self, secret: bytes, info: bytes, label: bytes, update_info: bytes) -> None:
        self.key = _first_key(secret, info, label)
        self.aead = AESGCM(self.key)
        self.seq = 0
        self.update_info = update_info

    def next(self) -> tuple[AESGCM, bytes]:
        """The key and nonce of the next record (moving to the next key when one is used
        up). Both at once: a caller must not look up the AEAD before the nonce."""
        if self.seq == REKEY_RECORDS:
            self.key = _next_key(self.key, self.update_info)
            self.aead = AESGCM(self.key)
            self.seq = 0
        nonce = _NONCE.pack(self.seq)
        self.seq += 1
        return self.aead, nonce


class AeadPipe:
    """Both directions of one connection's records (see the module docstring), with the
    same surface as :class:`~p2pdist.transport.tlspipe.TlsPipe`: ciphertext lands in
    :meth:`get_buffer`, plaintext comes out by :meth:`read_into`, :meth:`encrypt` makes
    the bytes for the socket."""

    __slots__ = (
        "_buf",
        "_cap",
        "_end",
        "_failed",
        "_grow",
        "_lean",
        "_max",
        "_offered",
        "_out",
        "_plain",
        "_plain_at",
        "_rx",
        "_start",
        "_tx",
        "_view",
        "records_in",
    )

    handshake_done = True
    closed_by_peer = False
    """Never: the frames' own GOODBYE ends a connection gracefully."""

    def __init__(
        self,
        send_secret: bytes,
        receive_secret: bytes,
        *,
        dialer: bool,
        info: bytes = INFO,
        lean: bool = False,
        max_record: int = MAX_RECORD,
        receive_buffer: int = RECEIVE_BUFFER,
    ) -> None:
        """``info`` names the protocol in the key derivation (it ends in " aes-256-gcm";
        the key updates use it with " key update" in place of that). ``lean``: keep no
        buffers while none is needed (ciphertext comes by :meth:`feed`, and the receive
        buffer is released whenever it is drained; a send buffer over 16 KiB is made per
        call), for a server with many mostly idle connections. ``max_record``: the
        largest plaintext of a record, sent or taken (a longer one received breaks the
        stream as soon as its length is here), at most :data:`MAX_RECORD`.
        ``receive_buffer``: how far the receive buffer grows (from
        :data:`RECEIVE_BUFFER`, by doubling) while socket reads fill all the room
        :meth:`get_buffer` offers, so that a busy socket is drained in few large reads;
        until it grows past :data:`RECEIVE_BUFFER`, room is made only when the buffer is
        full, as without it (not for a ``lean`` pipe, which is fed)."""
        if not 0 < max_record <= MAX_RECORD:
            raise ValueError(f"max_record must be 1..{MAX_RECORD}")
        if receive_buffer < RECEIVE_BUFFER:
            raise ValueError(f"receive_buffer must be at least {RECEIVE_BUFFER}")
        if send_secret == receive_secret:
            raise RecordError("the peer's record secret is our own")
        if not info.endswith(b" aes-256-gcm"):
            raise ValueError("info must end in ' aes-256-gcm'")
        mine, theirs = (b"dialer", b"acceptor") if dialer else (b"acceptor", b"dialer")
        update = info.removesuffix(b" aes-256-gcm") + b" key update"
        self._tx = _Direction(send_secret, info, mine, update)
        self._rx = _Direction(receive_secret, info, theirs, update)
        self._lean = lean
        self._max = max_record
        self._buf = bytearray(0 if lean else RECEIVE_BUFFER)
        self._cap = receive_buffer
        self._grow = False
        """Whether the last read filled all the room offered: grow before the next."""
        self._offered = 0
        self._view = memoryview(self._buf)
        self._failed: RecordError | None = None
        """Set once the stream is broken: every later read raises it."""
        self.records_in = 0
        """Records decrypted so far."""
        self._start = 0
        self._end = 0
        self._plain = memoryview(b"")
        """Plaintext of a record that did not fit the caller's buffer, not yet taken."""
        self._plain_at = 0
        self._out = bytearray()
        """Where :meth:`encrypt` writes (reused: the caller sends or copies it at once)."""

    # ---- receiving -------------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Where the next ciphertext from the socket must land (never empty)."""
        size = len(self._buf)
        if self._grow:  # the socket had more than the last read took
            self._grow = False
            self._move(max(size, min(2 * size, self._cap)))
        elif self._end == size:
            if self._start:  # a record's beginning: move it to the front
                self._move(size)
            else:  # a record larger than the buffer, or whole records wait: make room
                self._move(max(2 * size, RECEIVE_BUFFER))
        elif size > RECEIVE_BUFFER and self._start and 2 * self._end > size:
            self._move(size)  # a grown buffer: keep reads large (less than half is left)
        view = self._view[self._end :]
        self._offered = view.nbytes
        return view

    def _move(self, size: int) -> None:
        """What waits, to the front of a buffer of ``size`` bytes (this one, or a new
        one when ``size`` differs)."""
        n = self._end - self._start
        if size == len(self._buf):
            self._view[:n] = self._view[self._start : self._end]
        else:
            bigger = bytearray(size)
            bigger[:n] = self._view[self._start : self._end]
            self._buf, self._view = bigger, memoryview(bigger)
        self._start, self._end = 0, n

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` of ciphertext were written into the last :meth:`get_buffer`."""
        self._end += nbytes
        if nbytes == self._offered and len(self._buf) < self._cap:
            self._grow = True

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Ciphertext received some other way (what followed the keys in TLS's buffer,
        or everything, for a ``lean`` pipe)."""
        data = memoryview(data).cast("B")
        if self._lean and data.nbytes:
            # A buffer of exactly what waits and what came (let go once drained); a read
            # that ends inside a record, the common case, must not grow one step by
            # step. What waits is copied again on every feed: meant for records small
            # next to the reads (a relay's 64 KiB ones, 256 KiB reads).
            joined = bytearray(self._view[self._start : self._end])
            joined += data
            self._buf, self._view = joined, memoryview(joined)
            self._start, self._end = 0, len(joined)
            return
        while data.nbytes:
            buf = self.get_buffer()
            n = min(buf.nbytes, data.nbytes)
            buf[:n] = data[:n]
            self.buffer_updated(n)
            data = data[n:]

    @property
    def buffered(self) -> int:
        """Ciphertext received and not yet decrypted."""
        return self._end - self._start

    @property
    def stuck(self) -> bool:
        """Never: a partial record waits for the rest (its length was checked)."""
        return False

    @property
    def readable(self) -> bool:
        """Whether :meth:`read_into` has something now: a whole record, or plaintext of
        one that did not fit the last buffer."""
        if self._plain_at < self._plain.nbytes or self._failed is not None:
            return True
        length = self._length_here()
        # A bad length counts as readable: read_into then raises.
        return length is not None and (self._whole(length) or not self._valid(length))

    @property
    def next_size(self) -> int:
        """Plaintext bytes of the record :meth:`read_into` would decrypt next, when it is
        here whole (0 otherwise): a buffer smaller than that costs a temporary and a copy."""
        if self._plain_at < self._plain.nbytes:
            return 0
        length = self._length_here()
        if length is None or not self._valid(length) or not self._whole(length):
            return 0
        return length - TAG

    def _valid(self, length: int) -> bool:
        """Whether a record's length field is one the sender may write."""
        return TAG < length <= self._max + TAG

    def _length_here(self) -> int | None:
        """The length field of the record at the front, once its 4 bytes are here."""
        if self._end - self._start < _LEN.size:
            return None
        return int(_LEN.unpack_from(self._buf, self._start)[0])

    def _whole(self, length: int) -> bool:
        return self._end - self._start >= _LEN.size + length

    def _record_length(self) -> int:
        (length,) = _LEN.unpack_from(self._buf, self._start)
        if not self._valid(length):
            raise RecordError(f"a record of {length} bytes (at most {self._max + TAG})")
        return int(length)

    def read_into(self, buf: memoryview) -> int:
        """Decrypt into ``buf`` (non-empty): the bytes written, at most one record's
        worth; 0 when no whole record is here. Raises :class:`RecordError`."""
        if self._plain_at < self._plain.nbytes:
            n = min(buf.nbytes, self._plain.nbytes - self._plain_at)
            buf[:n] = self._plain[self._plain_at : self._plain_at + n]
            self._plain_at += n
            if self._plain_at == self._plain.nbytes:
                self._plain, self._plain_at = memoryview(b""), 0
            return n
        if self._failed is not None:
            raise self._failed
        start = self._start
        at = start + _LEN.size
        if self._end < at:
            return 0
        length = self._record_length()
        if self._end < at + length:
            return 0
        view = self._view
        header, cipher, size = view[start:at], view[at : at + length], length - TAG
        aead, nonce = self._rx.next()
        try:
            if size <= buf.nbytes:
                aead.decrypt_into(nonce, cipher, header, buf[:size])
                n = size
            else:  # the record does not fit: keep its plaintext for the next calls
                self._plain = memoryview(aead.decrypt(nonce, cipher, header))
                n = buf.nbytes
                buf[:] = self._plain[:n]
                self._plain_at = n
        except InvalidTag:
            if size <= buf.nbytes:  # decrypt_into wrote before it checked: unwrite it
                buf[:size] = bytes(size)
            raise self._broken() from None
        self._start = at + length
        self.records_in += 1
        if self._start == self._end:
            self._drained()
        elif self._lean:
            self._trim()
        return n

    def _broken(self) -> RecordError:
        self._failed = RecordError("a record does not decrypt (altered, replayed or cut)")
        return self._failed

    def _trim(self) -> None:
        """(Lean) Once the front record is not here whole, keep only its bytes, not the
        read they came with: a peer that ends every burst a few bytes into a record must
        not keep a whole read's buffer alive between its bursts."""
        start = self._start
        if not start:
            return
        length = self._length_here()
        if length is not None and (self._whole(length) or not self._valid(length)):
            return  # more to take now (or a bad length to raise): the caller goes on
        rest = bytearray(self._view[start : self._end])
        self._buf, self._view = rest, memoryview(rest)
        self._start, self._end = 0, len(rest)

    def _drained(self) -> None:
        """Every byte received was decrypted: start over at the front (a lean pipe lets
        its buffer go)."""
        self._start = self._end = 0
        if self._lean and self._buf:
            self._buf = bytearray()
            self._view = memoryview(self._buf)

    def fill(self, buf: memoryview) -> int:
        """Decrypt into ``buf`` (non-empty) as many whole records as fit, in order: the
        bytes written, 0 when no whole record is here. A record larger than the room
        left waits for the next call (check :attr:`next_size` to give it a place of its
        own), unless nothing was written yet: then it goes as :meth:`read_into` does.
        Raises :class:`RecordError`, but only once the records before the bad one were
        handed out (on the next call when some were written by this one).

        The per-record loop of :meth:`read_into` in one call: for small frames the
        Python around AES-GCM costs more than AES-GCM itself."""
        if self._plain_at < self._plain.nbytes or self._failed is not None:
            return self.read_into(buf)
        data, view, rx = self._buf, self._view, self._rx
        start, end, room, n = self._start, self._end, buf.nbytes, 0
        unpack, longest = _LEN.unpack_from, self._max + TAG
        while end - start >= _LEN.size:
            (length,) = unpack(data, start)
            at = start + _LEN.size
            if not TAG < length <= longest or end - at < length:
                break  # a bad length raises below (when nothing came before it)
            size = length - TAG
            if size > room - n:
                break
            aead, nonce = rx.next()
            try:
                aead.decrypt_into(nonce, view[at : at + length], view[start:at], buf[n : n + size])
            except InvalidTag:
                buf[n : n + size] = bytes(size)  # decrypt_into wrote before it checked
                err = self._broken()  # every later call raises it
                if not n:
                    raise err from None
                break  # hand out what came before it first
            n += size
            start = at + length
            self.records_in += 1
        self._start, self._end = start, end
        if start == end:
            self._drained()
        elif self._lean:
            self._trim()
        if start != end and not n and self.readable:
            return self.read_into(buf)  # whole but larger than buf, or a bad length
        return n

    # ---- sending ---------------------------------------------------------------------

    def encrypt(self, *parts: bytes | bytearray | memoryview, fresh: bool = False) -> memoryview:
        """The records of ``parts`` (a record per non-empty part; one over
        ``max_record`` bytes is cut into several), as one buffer for one socket write.
        Unless ``fresh``, the buffer is reused by the next call: send or copy it before
        then. ``fresh``: a new buffer nobody else writes (for a transport that queues a
        reference to what it could not send at once), in place of a copy of the reused
        one."""
        size, most = 0, self._max
        for p in parts:
            n = memoryview(p).nbytes
            size += n + (n + most - 1) // most * (_LEN.size + TAG)
        out = bytearray(size) if fresh else self._send_buffer(size)
        view = memoryview(out)
        at = 0
        for p in parts:
            data = memoryview(p).cast("B")
            for i in range(0, data.nbytes, most):
                piece = data[i : i + most]
                length = piece.nbytes + TAG
                _LEN.pack_into(out, at, length)
                end = at + _LEN.size + length
                aead, nonce = self._tx.next()
                header = view[at : at + _LEN.size]
                aead.encrypt_into(nonce, piece, header, view[at + _LEN.size : end])
                at = end
        return view[:at]

    def seal(self, data: bytes | bytearray) -> memoryview:
        """The one record of ``data`` (1 to ``max_record`` bytes): what
        :meth:`encrypt` makes of a single part, with less Python around it (a small
        frame's record). The buffer is reused by the next call, as :meth:`encrypt`'s."""
        length = len(data) + TAG
        if not self._valid(length):
            raise ValueError(f"{length - TAG} bytes for one record (1 to {self._max})")
        end = _LEN.size + length
        out = self._send_buffer(end)
        view = memoryview(out)
        _LEN.pack_into(out, 0, length)
        aead, nonce = self._tx.next()
        aead.encrypt_into(nonce, data, view[: _LEN.size], view[_LEN.size : end])
        return view[:end]

    def _send_buffer(self, size: int) -> bytearray:
        """At least ``size`` bytes to write records into: the kept one, grown if needed
        (a lean pipe keeps none over 16 KiB, it makes one for the call)."""
        out = self._out
        if len(out) < size:
            out = bytearray(size)
            if not self._lean or size <= _LEAN_OUT:
                self._out = out
        return out

    def outgoing(self) -> bytes:
        """Nothing: these records have no messages of their own."""
        return b""

    def close_notify(self) -> bytes:
        """Nothing to send (the frames' GOODBYE says it)."""
        return b""
