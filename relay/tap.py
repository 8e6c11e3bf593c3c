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

Never enable it on a production relay: it writes everything clients send to disk.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["FileTap", "Tap", "read_tap"]

Tap = Callable[[int, str, bytes], None]
"""``tap(conn_id, "in" | "out", data)``; called synchronously, must not raise."""

_RECORD = struct.Struct(">IBI")


class FileTap:
    """A :data:`Tap` that appends records to a file (flushed after each record)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: BinaryIO | None = path.open("ab")

    def __call__(self, conn_id: int, direction: str, data: bytes) -> None:
        if self._fh is None:
            return
        code = ord("i") if direction == "in" else ord("o")
        self._fh.write(_RECORD.pack(conn_id & 0xFFFFFFFF, code, len(data)))
        self._fh.write(data)
        self._fh.flush()

    def close(self) -> None:
        """Stop recording and close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_tap(path: Path) -> dict[tuple[int, str], bytes]:
    """``{(conn_id, "in" | "out"): all bytes in order}`` from a file written by FileTap."""
    data = path.read_bytes()
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
