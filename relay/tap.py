"""Debug tap: every byte the relay reads from and writes to client connections, after
TLS decryption (what the relay process itself handles in plaintext).

Used by tests that prove the relay never sees peers' plaintext: send a marker between
two peers through the relay, then check it appears in no stream the tap recorded.

* In process: pass ``tap=callable(conn_id, direction, data)`` to
  :class:`relay.server.RelayServer` (``direction`` is ``"in"`` or ``"out"``).
* Out of process: ``p2pdist-relay --tap FILE`` appends records to FILE, and
  :func:`read_tap` reassembles them into one byte string per connection and direction
  (so a marker split across reads is still found). Record format:
  ``conn_id u32 | direction u8 ('i' or 'o') | length u32 | data``, big-endian.

The file is created with mode 0600 (whatever the umask), the token in AUTH frames is
written as zero bytes of the same length (:class:`AuthRedactor`), and so are the record
secrets in both HTTP heads (:class:`HeadSecretRedactor`: with them and a capture of the
TCP stream, the AUTH could be decrypted): the rest of each AUTH frame, and everything
else, is recorded as read. Never enable it on a production relay:
it writes everything clients send to disk.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from p2pdist.wire.relay import _HEAD, FRAME_HEADER, MAX_HTTP_HEAD, RelayFrameType
from p2pdist.wire.websocket import Opcode, header_fields, header_size
from p2pdist.wire.websocket import mask as ws_mask

from .logfmt import kv

__all__ = ["AuthRedactor", "FileTap", "HeadSecretRedactor", "Tap", "read_tap"]

log = logging.getLogger(__name__)

Tap = Callable[[int, str, bytes], None]
"""``tap(conn_id, "in" | "out", data)``; called synchronously, must not raise."""

_RECORD = struct.Struct(">IBI")
_HEAD_END = b"\r\n\r\n"
_SECRET = re.compile(rb"key=([0-9A-Fa-f]+)", re.IGNORECASE)
_AUTH_FIXED = 32 + 64
"""An AUTH body is ``id 32 | signature 64 | token``: what follows these bytes is secret."""


class HeadSecretRedactor:
    """Follows the HTTP head at the start of one byte stream, either way (a client's
    upgrade, the relay's answer), across reads of any size, and zeroes the hex digits
    of every ``key=`` in it: the record secrets of ``P2pdist-Relay-Records``. With them,
    a capture of the TCP stream would decrypt the records, and the AUTH token in them.
    After the head, bytes go through as they are (no copy)."""

    def __init__(self) -> None:
        self._head = bytearray()  # the head so far (at most MAX_HTTP_HEAD and its end)
        self._done = False

    def __call__(self, data: bytes) -> bytes:
        """``data`` with the secret's digits in it replaced by zero bytes."""
        if self._done:
            return data
        start = len(self._head)
        self._head += data
        end = self._head.find(_HEAD_END)
        limit = end + len(_HEAD_END) if end >= 0 else len(self._head)
        out: bytearray | None = None
        # The whole head is searched again each read: digits split across reads are
        # found as one run, and only those in this read are blanked here.
        for match in _SECRET.finditer(self._head, 0, limit):
            a, b = max(match.start(1), start), match.end(1)
            if b > a:
                out = out if out is not None else bytearray(data)
                out[a - start : b - start] = bytes(b - a)
        if end >= 0 or len(self._head) > MAX_HTTP_HEAD + len(_HEAD_END):
            self._done, self._head = True, bytearray()
        return bytes(out) if out is not None else data


class AuthRedactor:
    """Follows one client-to-relay byte stream (an HTTP head, then relay frames, bare or
    in masked WebSocket frames) across reads of any size and zeroes the token bytes of
    every AUTH frame, keeping lengths. In WebSocket frames the masked bytes are zeroed
    (the mask key, which travels with them, no longer unmasks them to the token).

    Only framing is tracked (no bytes are kept), so a stream that is not what the relay
    expects merely goes through unredacted where it cannot be read as frames. A read
    with no token bytes in it is returned as it is (no copy). Every AUTH is followed, not
    only the first: the relay refuses a second one, but only after it was read (and
    tapped). Which framing follows the head is told by its second byte: a client's
    WebSocket frame has the mask bit there, a relay frame the top byte of a length that
    never reaches 2^24.
    """

    def __init__(self) -> None:
        self._head_tail = b""  # the last bytes of the HTTP head so far (up to 3)
        self._in_head = True
        self._websocket: bool | None = None  # None: not told yet (fewer than 2 bytes)
        self._first = b""  # the byte after the head, while the second is awaited
        # relay frames
        self._header = bytearray()  # a frame header split across reads
        self._left = 0  # bytes of the current frame body still to come
        self._secret = False  # the current frame is an AUTH (its token is secret)
        self._body_at = 0  # bytes of the current body seen so far
        # WebSocket frames around them
        self._ws_head = bytearray()  # a frame header split across reads
        self._ws_left = 0  # payload bytes of the current frame still to come
        self._ws_key = b""
        self._ws_offset = 0  # payload bytes of the current frame seen so far
        self._ws_data = False  # the current frame carries the relay stream

    def __call__(self, data: bytes) -> bytes:
        """``data`` with any AUTH token bytes in it replaced by zero bytes (``data``
        itself when it holds none)."""
        i = 0
        if self._in_head:
            joined = self._head_tail + data
            end = joined.find(_HEAD_END)
            if end < 0:
                self._head_tail = joined[-3:]
                return data
            self._in_head = False
            i = end + len(_HEAD_END) - len(self._head_tail)
        if self._websocket is None:
            if i >= len(data):
                return data
            if not self._first and i + 1 >= len(data):
                self._first = data[i:]  # the first byte alone: a header byte either way
                return data
            second = data[i + 1] if not self._first else data[i]
            self._websocket = bool(second & 0x80)
            target = self._ws_head if self._websocket else self._header
            target += self._first  # the first header byte, seen in the last read
        blank = self._websocket_spans(data, i) if self._websocket else self._relay_spans(data, i)
        if not blank:
            return data
        out = bytearray(data)
        for start, stop in blank:
            out[start:stop] = bytes(stop - start)
        return bytes(out)

    def _relay_spans(self, data: bytes | bytearray, i: int) -> list[tuple[int, int]]:
        """Follow relay frames through ``data[i:]``: the spans of token bytes in it."""
        spans: list[tuple[int, int]] = []
        n = len(data)
        while i < n:
            if self._left == 0:  # a frame header next
                if self._header or n - i < FRAME_HEADER:  # split across reads
                    take = min(FRAME_HEADER - len(self._header), n - i)
                    self._header += data[i : i + take]
                    i += take
                    if len(self._header) < FRAME_HEADER:
                        break
                    kind, self._left = _HEAD.unpack_from(self._header)
                    self._header.clear()
                else:
                    kind, self._left = _HEAD.unpack_from(data, i)
                    i += FRAME_HEADER
                self._secret = kind == RelayFrameType.AUTH
                self._body_at = 0
                continue
            take = min(self._left, n - i)
            if self._secret:
                start = max(self._body_at, _AUTH_FIXED) - self._body_at
                if start < take:
                    spans.append((i + start, i + take))
            self._body_at += take
            self._left -= take
            i += take
        return spans

    def _websocket_spans(self, data: bytes, i: int) -> list[tuple[int, int]]:
        """Follow WebSocket frames through ``data[i:]``, the relay stream in their
        (unmasked) payloads: the spans of ``data`` that carry token bytes."""
        spans: list[tuple[int, int]] = []
        n = len(data)
        while i < n:
            if self._ws_left == 0:  # a frame header next
                take = min(self._ws_head_size() - len(self._ws_head), n - i)
                self._ws_head += data[i : i + take]
                i += take
                if len(self._ws_head) < self._ws_head_size():
                    continue  # (the size grows once its second byte is in)
                self._ws_begin()
                continue
            take = min(self._ws_left, n - i)
            if self._ws_data:
                clear = ws_mask(data[i : i + take], self._ws_key, self._ws_offset)
                spans += [(i + a, i + b) for a, b in self._relay_spans(clear, 0)]
            self._ws_offset += take
            self._ws_left -= take
            i += take
        return spans

    def _ws_head_size(self) -> int:
        """Bytes of the header being read (2 until its second byte tells more)."""
        head = self._ws_head
        return 2 if len(head) < 2 else header_size(head[1])

    def _ws_begin(self) -> None:
        """A whole frame header is in: start its payload."""
        head, self._ws_head = bytes(self._ws_head), bytearray()
        opcode, self._ws_left, key = header_fields(head)
        self._ws_key, self._ws_offset = key or bytes(4), 0
        # TEXT too: the relay refuses it, but only after the read was tapped.
        self._ws_data = opcode in (Opcode.CONTINUATION, Opcode.TEXT, Opcode.BINARY)


class FileTap:
    """A :data:`Tap` that appends records to a file (flushed after each record)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask, and for a file left from before
        except OSError as exc:  # pragma: no cover - a file someone else owns
            log.warning(kv("tap_chmod_failed", path=path, error=exc))
        self._fh: BinaryIO | None = os.fdopen(fd, "ab")
        self._redactors: dict[int, AuthRedactor] = {}
        self._heads: dict[tuple[int, str], HeadSecretRedactor] = {}

    def __call__(self, conn_id: int, direction: str, data: bytes) -> None:
        if self._fh is None:
            return
        head = self._heads.get((conn_id, direction))
        if head is None:
            head = self._heads[(conn_id, direction)] = HeadSecretRedactor()
        data = head(data)
        if direction == "in":
            redact = self._redactors.get(conn_id)
            if redact is None:
                redact = self._redactors[conn_id] = AuthRedactor()
            data = redact(data)
        code = ord("i") if direction == "in" else ord("o")
        self._fh.write(_RECORD.pack(conn_id & 0xFFFFFFFF, code, len(data)))
        self._fh.write(data)
        self._fh.flush()

    def forget(self, conn_id: int) -> None:
        """Connection ``conn_id`` closed: drop its redactor (one per open connection)."""
        self._redactors.pop(conn_id, None)
        for direction in ("in", "out"):
            self._heads.pop((conn_id, direction), None)

    def close(self) -> None:
        """Stop recording and close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_tap(path: str | os.PathLike[str]) -> dict[tuple[int, str], bytes]:
    """``{(conn_id, "in" | "out"): all bytes in order}`` from a file written by FileTap
    (``--tap FILE``)."""
    data = Path(path).read_bytes()
    streams: dict[tuple[int, str], bytearray] = {}
    off = 0
    while off + _RECORD.size <= len(data):
        conn, code, length = _RECORD.unpack_from(data, off)
        off += _RECORD.size
        chunk = data[off : off + length]
        off += length
        key = (conn, "in" if code == ord("i") else "out")
        streams.setdefault(key, bytearray()).extend(chunk)
    return {k: bytes(v) for k, v in streams.items()}
