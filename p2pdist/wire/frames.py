"""Frame codec (sans-I/O).

Every frame is a fixed 32-byte big-endian header, then ``meta_len`` bytes of metadata
(msgpack, small) and ``payload_len`` bytes of raw payload::

    version u8 | kind u8 | flags u16 | meta_len u32 | channel u64 | seq u64 | payload_len u64

:class:`FrameDecoder` is driven the way ``asyncio.BufferedProtocol`` is: ask it for a buffer
with :meth:`FrameDecoder.get_buffer`, write received bytes into it, and report the count with
:meth:`FrameDecoder.buffer_updated`. Small frames are assembled in a scratch buffer; a large
payload is received straight into a buffer of its own, so bulk data is copied once, from
the kernel into its final buffer (taken from a :class:`BufferPool`, which hands out again
the buffers receivers have let go). A receiver that knows where a message belongs
(a collective's output array) names that place beforehand with :meth:`FrameDecoder.expect`,
and the payload is received there instead, with no copy after it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from .bufpool import BufferPool

__all__ = [
    "HEADER",
    "VERSION",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "FrameKind",
    "FrameLimits",
    "encode_data_header",
    "encode_header",
    "fill_buffers",
]

VERSION = 1
HEADER = struct.Struct(">BBHIQQQ")
assert HEADER.size == 32
PEEK_BYTES = 256
"""The room a peeking reader is offered after a large payload (see
:meth:`FrameDecoder.get_buffer`): a header and a little meta."""
U64_MAX = (1 << 64) - 1


class FrameKind(enum.IntEnum):
    """What a frame carries."""

    DATA = 1  # meta + payload for one channel
    PING = 2  # keepalive request
    PONG = 3  # keepalive answer
    GOODBYE = 4  # orderly close: the sender will send nothing more


class FrameError(Exception):
    """A frame broke the codec's rules; the glue turns this into RemoteProtocolError.

    ``frames`` holds the well-formed frames that were decoded from the same input before the
    bad bytes (the glue should still deliver them). After raising, the decoder is failed:
    every later call raises :class:`FrameError` again.
    """

    def __init__(self, message: str, frames: list[Frame] | None = None) -> None:
        super().__init__(message)
        self.frames: list[Frame] = frames if frames is not None else []


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Hard limits enforced on every received frame (and checked on send)."""

    max_meta: int = 64 * 1024
    """Largest metadata block, bytes."""
    max_payload: int = 1 << 30
    """Largest payload, bytes (1 GiB). Collectives chunk far below this."""
    direct_threshold: int = 64 * 1024
    """Payloads larger than this are received straight into their own buffer."""


class Frame(NamedTuple):
    """One decoded frame. ``payload`` is writable and owned by the frame.

    A named tuple, not a frozen dataclass: one is made per received message, and a tuple
    is built in one step where a frozen dataclass sets each field through a call."""

    kind: FrameKind
    channel: int
    seq: int
    meta: bytes
    payload: memoryview
    flags: int = 0
    placed: bool = False
    """The payload was received straight into the place the receiver named
    (:meth:`FrameDecoder.expect`): it takes no memory of the connection's."""

    @property
    def nbytes(self) -> int:
        """Bytes this frame occupies in memory (meta + payload)."""
        return len(self.meta) + self.payload.nbytes


def _check_fields(
    channel: int, seq: int, meta: bytes, payload_len: int, limits: FrameLimits
) -> None:
    """The checks that every header gets: meta and payload within ``limits``, channel and
    seq in 64 unsigned bits (``payload_len >= 0`` is the caller's)."""
    if len(meta) > limits.max_meta:
        raise ValueError(f"frame meta {len(meta)} bytes exceeds limit {limits.max_meta}")
    if payload_len > limits.max_payload:
        raise ValueError(f"frame payload {payload_len} bytes exceeds limit {limits.max_payload}")
    if not (0 <= channel <= U64_MAX and 0 <= seq <= U64_MAX):
        raise ValueError("channel and seq must fit in 64 unsigned bits")


def encode_header(
    kind: FrameKind,
    channel: int = 0,
    seq: int = 0,
    meta: bytes = b"",
    payload_len: int = 0,
    *,
    flags: int = 0,
    limits: FrameLimits | None = None,
) -> bytes:
    """The header plus ``meta``; the caller sends ``payload_len`` payload bytes after it."""
    lim = limits or FrameLimits()
    kind = FrameKind(kind)
    if kind is not FrameKind.DATA and (meta or payload_len):
        raise ValueError(f"{kind.name} frames carry no meta or payload")
    if payload_len < 0 or not 0 <= flags <= 0xFFFF:
        raise ValueError("payload_len must be >= 0 and flags must fit in 16 bits")
    _check_fields(channel, seq, meta, payload_len, lim)
    return HEADER.pack(VERSION, int(kind), flags, len(meta), channel, seq, payload_len) + meta


def encode_data_header(
    channel: int, seq: int, meta: bytes, payload_len: int, limits: FrameLimits
) -> bytes:
    """:func:`encode_header` for a DATA frame without flags: the per-message fast path
    (same checks, same bytes, no enum conversion)."""
    _check_fields(channel, seq, meta, payload_len, limits)
    return _pack(VERSION, _DATA, 0, len(meta), channel, seq, payload_len) + meta


_pack = HEADER.pack
_DATA = int(FrameKind.DATA)
_EMPTY = memoryview(bytearray())


def fill_buffers(
    get_buffer: Callable[[], memoryview], data: bytes | bytearray | memoryview
) -> Iterator[int]:
    """Copy ``data`` into the buffers ``get_buffer()`` hands out, as a BufferedProtocol's
    transport would, yielding how many bytes went into each (for feeding a receive-in-
    place decoder bytes that arrived some other way)."""
    src = memoryview(data).cast("B")
    while src.nbytes:
        room = get_buffer()
        n = min(room.nbytes, src.nbytes)
        room[:n] = src[:n]
        src = src[n:]
        yield n


class FrameDecoder:
    """Incremental frame parser; raises :class:`FrameError` on malformed input."""

    def __init__(
        self,
        limits: FrameLimits | None = None,
        scratch_size: int = 256 * 1024,
        pool_bytes: int = 4 << 20,
    ) -> None:
        self.limits = limits or FrameLimits()
        if scratch_size < HEADER.size + self.limits.max_meta + self.limits.direct_threshold:
            scratch_size = HEADER.size + self.limits.max_meta + self.limits.direct_threshold
        self._scratch_size = scratch_size
        self._scratch = bytearray()
        """Allocated on the first :meth:`get_buffer` (by :meth:`_compact`), not here: a
        connection still handshaking (unauthenticated) holds no scratch buffer."""
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # State while a large payload is being received directly.
        self._pending: tuple[FrameKind, int, int, int, bytes] | None = None
        self._payload: memoryview | None = None
        self._filled = 0
        self._into_place = False
        """Whether ``_payload`` is a place named by :meth:`expect` (a caller's memory)."""
        self._discarding = 0
        """Bytes still to throw away of a payload whose place was forgotten mid-way."""
        self.landed = 0
        """Frames received into a place named by :meth:`expect`."""
        self._peek_next = False
        """Whether a large payload just ended: a reader that asks to peek then gets room
        for the next header only (:meth:`get_buffer`)."""
        self._peeked = False
        """Whether the last room handed out was a peek's."""
        self.read_again = False
        """Whether the last read filled a peek's room: more may be waiting, to be read at
        once (the payload behind the header, straight into its place)."""
        self._places: dict[int, dict[int, memoryview]] = {}
        self._pool = BufferPool(pool_bytes)
        self._failure: str | None = None

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has arrived but not all of it."""
        return self._payload is not None or self._end > self._start or self._discarding > 0

    def expect(self, channel: int, seq: int, place: memoryview) -> None:
        """Receive the payload of DATA frame ``(channel, seq)`` straight into ``place`` (a
        writable, contiguous 1-D byte view), if that frame has not been decoded, nor begun to be
        received into a buffer of its own, before this call and its payload is exactly
        ``place.nbytes`` long; the frame then carries ``place`` itself as its payload.
        Otherwise the frame is decoded as usual (the receiver sees the size mismatch, or
        copies a frame that came early). :attr:`landed` counts the frames that used a
        place."""
        if place.readonly or place.ndim != 1 or place.format != "B" or not place.contiguous:
            raise ValueError("a landing place must be a writable, contiguous 1-D view of bytes")
        self._places.setdefault(channel, {})[seq] = place

    def named_channels(self) -> list[int]:
        """The channels with places named (or a payload coming into one)."""
        pending = self._pending
        coming = [pending[2]] if pending is not None and self._into_place else []
        return [*self._places, *coming]

    def forget(self, channel: int) -> None:
        """Drop the places named for ``channel``. The rest of a payload being received
        into one of them is read into the (then empty) scratch buffer and thrown away,
        so nothing writes into a caller's memory after the caller has moved on; that
        frame is not delivered (it belongs to a retired channel)."""
        if self._places:
            self._places.pop(channel, None)
        pending = self._pending
        if pending is not None and self._into_place and pending[2] == channel:
            assert self._payload is not None
            self._discarding = self._payload.nbytes - self._filled
            self._pending, self._payload, self._filled = None, None, 0
            self._into_place = False

    def _take_place(self, channel: int, seq: int, nbytes: int) -> memoryview | None:
        """The place named for ``(channel, seq)``, if its size is ``nbytes`` (used up)."""
        places = self._places.get(channel)
        if places is None:
            return None
        place = places.pop(seq, None)
        if not places:
            del self._places[channel]
        return place if place is not None and place.nbytes == nbytes else None

    def get_buffer(self, peek: bool = False) -> memoryview:
        """Where the next received bytes must be written (never empty).

        With ``peek``, right after a large payload, the room is :data:`PEEK_BYTES`: the
        next frame's header comes alone, so that a large payload behind it is received
        straight into its place, not first into the scratch buffer and then copied
        there. A reader that peeks reads again at once when :attr:`read_again` says so
        (the header and its payload are usually here together)."""
        if self._payload is not None:
            return self._payload[self._filled :]
        if self._discarding:
            return self._view[: min(self._discarding, len(self._scratch))]
        if peek and self._peek_next:  # the scratch buffer is empty after a large payload
            # Until bytes come (buffer_updated): a read that found none (the receiver
            # looked before it waited, or uvloop's reader read on) must not use it up.
            self._peeked = True
            return self._view[:PEEK_BYTES]
        # Any other room may be written: a peek after it would write over what came.
        self._peeked = self._peek_next = False
        if self._end == len(self._scratch) or (
            self._start > 0 and len(self._scratch) - self._end < HEADER.size
        ):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer; return completed frames."""
        if self._failure is not None:
            raise FrameError(self._failure)
        self.read_again = self._peeked and nbytes == PEEK_BYTES
        self._peeked = self._peek_next = False  # (_finish_direct sets it again)
        if self._payload is not None:
            self._filled += nbytes
            if self._filled < self._payload.nbytes:
                return []
            return [self._finish_direct()]
        if self._discarding:
            self._discarding -= nbytes
            return []
        self._end += nbytes
        return self._parse()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Push arbitrary bytes through the decoder (for tests and non-buffered glue)."""
        out: list[Frame] = []
        for n in fill_buffers(self.get_buffer, data):
            try:
                out.extend(self.buffer_updated(n))
            except FrameError as exc:
                exc.frames[:0] = out
                raise
        return out

    def _compact(self) -> None:
        if not self._scratch:  # the first bytes: allocate the scratch buffer now
            self._scratch = bytearray(self._scratch_size)
            self._view = memoryview(self._scratch)
            return
        n = self._end - self._start
        if self._start:
            self._view[:n] = self._view[self._start : self._end]  # one memmove, no temporary
        self._start, self._end = 0, n

    def _finish_direct(self) -> Frame:
        assert self._pending is not None and self._payload is not None
        kind, flags, channel, seq, meta = self._pending
        frame = Frame(kind, channel, seq, meta, self._payload, flags, self._into_place)
        self._pending, self._payload, self._filled = None, None, 0
        self._into_place = False
        self._peek_next = True
        return frame  # the scratch buffer was emptied when the direct receive began

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        try:
            self._parse_into(frames)
        except FrameError as exc:
            self._failure = str(exc)
            exc.frames[:0] = frames
            raise
        return frames

    def _parse_into(self, frames: list[Frame]) -> None:
        lim = self.limits
        while self._end - self._start >= HEADER.size:
            s = self._start
            version, kind_raw, flags, meta_len, channel, seq, payload_len = HEADER.unpack_from(
                self._scratch, s
            )
            kind = _KINDS.get(kind_raw) if version == VERSION else None
            if kind is None:
                kind = _check_start(version, kind_raw)  # raises, naming what is wrong
            if meta_len > lim.max_meta:
                raise FrameError(
                    f"frame meta of {meta_len} bytes exceeds limit {lim.max_meta} "
                    "(this side's FrameLimits.max_meta)"
                )
            if payload_len > lim.max_payload:
                # Both sides must allow the frame; a sender with a larger limit sent it.
                raise FrameError(
                    f"frame payload of {payload_len} bytes exceeds limit {lim.max_payload} "
                    "(this side's FrameLimits.max_payload, in TransportConfig.limits: the "
                    "sender's is larger)"
                )
            if kind is not FrameKind.DATA and (meta_len or payload_len):
                raise FrameError(f"{kind.name} frame must be empty")
            body = s + HEADER.size
            avail = self._end - body
            if avail < meta_len:
                break
            meta = bytes(self._view[body : body + meta_len])
            pstart = body + meta_len
            have = self._end - pstart
            if payload_len > lim.direct_threshold and have < payload_len:
                # Large payload: copy what already arrived, receive the rest in place, into
                # the place the receiver named or else a buffer of the frame's own.
                place = self._take_place(channel, seq, payload_len) if self._places else None
                self._into_place = place is not None
                if place is None:
                    place = self._pool.take(payload_len)
                else:
                    self.landed += 1
                place[:have] = self._view[pstart : self._end]
                self._start = self._end = 0
                self._pending = (kind, flags, channel, seq, meta)
                self._payload, self._filled = place, have
                return
            if have < payload_len:
                break
            end = pstart + payload_len
            # Only a payload takes a place: an empty frame (a PING is channel 0, seq 0)
            # must not use up the place of the message that shares its numbers.
            place = (
                self._take_place(channel, seq, payload_len)
                if payload_len and self._places
                else None
            )
            if place is not None:
                place[:] = self._view[pstart:end]
                owned = place
                self.landed += 1
            else:  # a bytearray slice is one copy, into a buffer the frame owns
                owned = memoryview(self._scratch[pstart:end]) if payload_len else _EMPTY
            frames.append(
                _new_frame(Frame, (kind, channel, seq, meta, owned, flags, place is not None))
            )
            self._start = end
        partial = self._end - self._start
        if 0 < partial < HEADER.size:
            # Refuse a bad version or kind as soon as its byte arrives: a stranger sending
            # a short line (or nothing more) is refused at once, not when more bytes come.
            s = self._start
            kind_raw = self._scratch[s + 1] if partial > 1 else FrameKind.DATA  # not here yet
            _check_start(self._scratch[s], kind_raw)
        if self._start == self._end:
            self._start = self._end = 0


_KINDS: dict[int, FrameKind] = {int(k): k for k in FrameKind}
_new_frame = tuple.__new__
"""``Frame(...)`` without the Python-level ``__new__`` NamedTuple generates (once per
small frame received, the latency path)."""


def _check_start(version: int, kind_raw: int) -> FrameKind:
    """Validate a header's first two bytes."""
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (expected {VERSION})")
    kind = _KINDS.get(kind_raw)  # a table lookup: FrameKind(x) costs a call per frame
    if kind is None:
        raise FrameError(f"unknown frame kind {kind_raw}")
    return kind
