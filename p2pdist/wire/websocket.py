"""WebSocket framing (RFC 6455), sans-I/O: the relay session's bytes through HTTP proxies.

A relay session carries one byte stream of relay frames. Behind a reverse proxy that
only lets WebSocket upgrades through (a cloud load balancer, a CDN, nginx configured
for WebSockets), that stream travels in WebSocket binary frames: any frame carries any
run of the stream's bytes, so relay frames may span WebSocket frames and the other way
round. This module makes and reads those frames; it keeps no sockets.

- :func:`client_key` / :func:`accept_for`: the ``Sec-WebSocket-Key`` and
  ``Sec-WebSocket-Accept`` of the opening handshake (RFC 6455 4.1, 4.2.2).
- :func:`frame`: one frame (masked with a fresh key when the client sends it, 5.3).
- :class:`WebSocketReader`: splits received bytes into data and control frames, unmasks
  as bytes arrive and never holds a whole data frame (a frame may announce up to 2^63
  bytes; only control frames, at most 125 bytes, are collected).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

__all__ = [
    "CONTROL_MAX",
    "WS_GUID",
    "Opcode",
    "WebSocketError",
    "WebSocketEvent",
    "WebSocketReader",
    "accept_for",
    "client_key",
    "close_frame",
    "echo_code",
    "frame",
    "header_fields",
    "header_size",
    "header",
    "mask",
    "valid_key",
]

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
"""RFC 6455 1.3: appended to the client's key before hashing it into the accept value."""
CONTROL_MAX = 125
"""The largest control frame payload (RFC 6455 5.5)."""
_HEADER_MAX = 14


class Opcode(IntEnum):
    """WebSocket frame opcodes (RFC 6455 5.2)."""

    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


class WebSocketError(ValueError):
    """Bytes that break RFC 6455 (or what the relay protocol allows in it).

    ``events``: what the same :meth:`WebSocketReader.feed` read before the bad bytes (a
    relay's last frames before them still count)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.events: list[WebSocketEvent] = []


def client_key() -> str:
    """A fresh ``Sec-WebSocket-Key``: 16 random bytes, base64."""
    return base64.b64encode(secrets.token_bytes(16)).decode("ascii")


def valid_key(key: str) -> bool:
    """Whether ``key`` is base64 of exactly 16 bytes (RFC 6455 4.1, item 7)."""
    try:
        return len(base64.b64decode(key.encode("ascii"), validate=True)) == 16
    except (binascii.Error, UnicodeEncodeError):
        return False


def accept_for(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` that answers ``key``."""
    digest = hashlib.sha1(key.encode("ascii") + WS_GUID, usedforsecurity=False).digest()
    return base64.b64encode(digest).decode("ascii")


def mask(data: bytes | bytearray | memoryview, key: bytes, offset: int = 0) -> bytearray:
    """``data`` XOR the 4-byte ``key`` (the same call unmasks), starting ``offset``
    bytes into the frame's payload (for payloads that arrive in pieces)."""
    view = memoryview(data).cast("B")
    out = bytearray(len(view))
    _xor_into(view, key, offset, memoryview(out))
    return out


def _xor_into(view: memoryview, key: bytes, offset: int, out: memoryview) -> None:
    """``out[:] = view XOR key`` (rotated by ``offset``): the whole words through numpy,
    the last 0-3 bytes one by one."""
    n = len(view)
    shift = offset & 3
    rotated = key[shift:] + key[:shift]
    words = n >> 2
    if words:
        np.bitwise_xor(
            np.frombuffer(view, dtype="<u4", count=words),
            np.uint32(int.from_bytes(rotated, "little")),
            out=np.frombuffer(out, dtype="<u4", count=words),
        )
    for i in range(words << 2, n):
        out[i] = view[i] ^ rotated[i & 3]


def header(length: int, opcode: Opcode = Opcode.BINARY, key: bytes | None = None) -> bytes:
    """The header of one whole frame (FIN set) of ``length`` payload bytes, masked with
    ``key`` when given."""
    first = 0x80 | opcode
    bit = 0x80 if key is not None else 0
    if length < 126:
        head = struct.pack("!BB", first, bit | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", first, bit | 126, length)
    else:
        head = struct.pack("!BBQ", first, bit | 127, length)
    return head + key if key is not None else head


def frame(
    payload: bytes | bytearray | memoryview, opcode: Opcode = Opcode.BINARY, *, masked: bool
) -> bytearray:
    """One whole frame, built with one copy of ``payload``; ``masked`` (a client's
    frames) picks a fresh key for it."""
    view = memoryview(payload).cast("B")
    if opcode >= Opcode.CLOSE and len(view) > CONTROL_MAX:
        raise ValueError(f"a control frame carries at most {CONTROL_MAX} bytes")
    key = secrets.token_bytes(4) if masked else None
    out = bytearray(header(len(view), opcode, key))
    if key is None:
        out += view
        return out
    start = len(out)
    out.extend(bytes(len(view)))  # room for the masked payload, written in place
    _xor_into(view, key, 0, memoryview(out)[start:])
    return out


def echo_code(payload: bytes | bytearray) -> bytes:
    """The status code to answer a CLOSE with (RFC 6455 5.5.1, 7.4): its own code when
    it is one an endpoint may send, 1000 for a CLOSE without one, 1002 otherwise (a
    one-byte body, or a code reserved for local use such as 1005/1006/1015)."""
    if not payload:
        return b"\x03\xe8"
    if len(payload) >= 2:
        code = int.from_bytes(payload[:2], "big")
        if 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999:
            return bytes(payload[:2])
    return b"\x03\xea"


def close_frame(code: int = 1000, reason: str = "", *, masked: bool) -> bytearray:
    """A CLOSE frame with a status ``code`` and a short UTF-8 ``reason``."""
    body = struct.pack("!H", code) + reason.encode("utf-8")[: CONTROL_MAX - 2]
    return frame(body, Opcode.CLOSE, masked=masked)


@dataclass(frozen=True, slots=True)
class WebSocketEvent:
    """Bytes of the data stream (``opcode`` BINARY, whatever frame carried them), or one
    whole control frame (CLOSE, PING, PONG) with its payload."""

    opcode: Opcode
    payload: bytes | bytearray


def _joined(pieces: list[bytes | bytearray]) -> bytes | bytearray:
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def header_size(second: int) -> int:
    """Bytes of a frame header whose second byte is ``second``: 2 to 14, with the
    extended length and the mask key it announces."""
    size = second & 0x7F
    return 2 + (2 if size == 126 else 8 if size == 127 else 0) + (4 if second & 0x80 else 0)


def header_fields(head: bytes) -> tuple[int, int, bytes]:
    """A whole frame header's opcode (its 4 bits, unchecked), payload length and mask
    key (b"" when unmasked)."""
    size, at = head[1] & 0x7F, 2
    if size == 126:
        (size,), at = struct.unpack_from("!H", head, 2), 4
    elif size == 127:
        (size,), at = struct.unpack_from("!Q", head, 2), 10
    return head[0] & 0x0F, size, head[at : at + 4] if head[1] & 0x80 else b""


class WebSocketReader:
    """Turns received bytes into :class:`WebSocketEvent` s.

    ``masked``: whether frames must be masked (a server reading a client) or must not be
    (a client reading a server); RFC 6455 5.1 makes either mistake fatal. Text frames
    are refused: the relay stream is binary. Data arrives as it comes, a frame's payload
    possibly in several events; consecutive data bytes of one :meth:`feed` are joined.
    """

    def __init__(self, *, masked: bool) -> None:
        self._masked = masked
        self._head = bytearray()
        self._active = False
        """Whether a frame's header has been read and its payload is being read."""
        self._left = 0
        """Payload bytes of the current frame not yet read."""
        self._offset = 0
        self._key = b""
        self._opcode = Opcode.BINARY
        self._control = bytearray()
        self._fragmented = False
        """Whether a data message has begun and not finished (continuations are due)."""
        self.closed = False
        """Whether a CLOSE frame was read (nothing after it is read)."""
        self.frames = 0
        """Frame headers read so far (an empty data frame makes no event, and the data
        frames of one :meth:`feed` make one: a reader that charges per frame counts
        these)."""

    def feed(self, data: bytes | bytearray | memoryview) -> list[WebSocketEvent]:
        """Read ``data``; WebSocketError when it breaks the framing (then stop feeding),
        with the events read before the bad bytes."""
        events: list[WebSocketEvent] = []
        pending: list[bytes | bytearray] = []
        try:
            self._read(data, events, pending)
        except WebSocketError as exc:
            if pending:
                events.append(WebSocketEvent(Opcode.BINARY, _joined(pending)))
            exc.events = events
            raise
        if pending:
            events.append(WebSocketEvent(Opcode.BINARY, _joined(pending)))
        return events

    def _read(
        self,
        data: bytes | bytearray | memoryview,
        events: list[WebSocketEvent],
        pending: list[bytes | bytearray],
    ) -> None:
        view = memoryview(data).cast("B")
        pos, end = 0, len(view)
        while pos < end and not self.closed:
            if not self._active:
                pos = self._read_header(view, pos)
                if not self._active:
                    break  # the header is not complete yet
                if not self._left:
                    self._complete(events, pending)
                    continue
            take = min(self._left, end - pos)
            piece = view[pos : pos + take]
            pos += take
            clear = mask(piece, self._key, self._offset) if self._masked else bytes(piece)
            self._offset += take
            self._left -= take
            if self._opcode >= Opcode.CLOSE:
                self._control += clear
            else:
                pending.append(clear)
            if not self._left:
                self._complete(events, pending)

    def _read_header(self, view: memoryview, pos: int) -> int:
        """Collect header bytes from ``view[pos:]``; starts the frame once all are in."""
        if not self._head and len(view) - pos >= 2:  # the usual case: a whole header here
            need = header_size(view[pos + 1])
            if len(view) - pos >= need:
                self._start(bytes(view[pos : pos + need]))
                return pos + need
        need = 2
        while True:
            have = len(self._head)
            if have < need:
                take = min(need - have, len(view) - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) < need:
                    return pos
            need = header_size(self._head[1])
            if len(self._head) >= need:
                break
        head, self._head = bytes(self._head), bytearray()
        self._start(head)
        return pos

    def _start(self, head: bytes) -> None:
        self.frames += 1
        if head[0] & 0x70:
            raise WebSocketError("reserved bits set (no extension was agreed)")
        bits, size, key = header_fields(head)
        try:
            opcode = Opcode(bits)
        except ValueError:
            raise WebSocketError(f"unknown opcode {bits:#x}") from None
        fin = bool(head[0] & 0x80)
        masked = bool(head[1] & 0x80)
        if masked != self._masked:
            raise WebSocketError("unmasked client frame" if self._masked else "masked server frame")
        if size >> 63:
            raise WebSocketError("frame length with its top bit set")
        if opcode is Opcode.TEXT:
            raise WebSocketError("text frame (the relay stream is binary)")
        if opcode >= Opcode.CLOSE:
            if not fin or size > CONTROL_MAX:
                raise WebSocketError("fragmented or oversized control frame")
        elif opcode is Opcode.CONTINUATION:
            if not self._fragmented:
                raise WebSocketError("continuation frame without a message to continue")
            self._fragmented = not fin
        else:
            if self._fragmented:
                raise WebSocketError("new message before the last one finished")
            self._fragmented = not fin
        self._key = key
        self._opcode = opcode
        self._left = size
        self._offset = 0
        self._control = bytearray()
        self._active = True

    def _complete(self, events: list[WebSocketEvent], pending: list[bytes | bytearray]) -> None:
        """The current frame is read: a control frame becomes an event (after the data
        read before it, which keeps its place)."""
        self._active = False
        if self._opcode < Opcode.CLOSE:
            return
        if pending:
            events.append(WebSocketEvent(Opcode.BINARY, _joined(pending)))
            pending.clear()
        events.append(WebSocketEvent(self._opcode, bytes(self._control)))
        if self._opcode is Opcode.CLOSE:
            self.closed = True
