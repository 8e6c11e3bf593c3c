"""Connection handshake records (sans-I/O).

Before any frame flows, the dialing side (client) and the accepting side (server)
exchange small length-prefixed msgpack records::

    client -> server   b"P2PD" version:u8, then record ClientHello
    server -> client   record ServerHello  (ok, or a refusal with a reason)
    TLS mode:          TLS 1.3 with both certificates pinned to the endpoint ids
    plaintext mode:    record Auth from the client, then record Auth from the server

A record is ``length:u32 big-endian`` then that many bytes of msgpack (a map).
``auth_transcript`` is what each side signs in plaintext mode; it binds both ids, both
fresh nonces and the role, so a signature can be neither replayed nor reflected.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = [
    "HandshakeError",
    "MAGIC",
    "MAX_RECORD",
    "RecordReader",
    "auth_transcript",
    "encode_record",
    "get_bytes",
]

MAGIC = b"P2PD\x01"
MAX_RECORD = 16 * 1024
_LEN = struct.Struct(">I")


class HandshakeError(Exception):
    """The peer's handshake bytes are malformed."""


def encode_record(fields: dict[str, Any], *, first: bool = False) -> bytes:
    """One record (with the magic prefix when it is the client's first)."""
    body: bytes = msgpack.packb(fields, use_bin_type=True)
    if len(body) > MAX_RECORD:
        raise ValueError("handshake record too large")
    return (MAGIC if first else b"") + _LEN.pack(len(body)) + body


@dataclass
class RecordReader:
    """Collects bytes and yields complete records; checks the magic when ``expect_magic``."""

    expect_magic: bool = False
    _buf: bytearray = field(default_factory=bytearray, init=False, repr=False)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        self._buf += data

    def __len__(self) -> int:
        return len(self._buf)

    def next_record(self) -> dict[str, Any] | None:
        """The next complete record, or None when more bytes are needed."""
        buf = self._buf
        if self.expect_magic:
            if len(buf) < len(MAGIC):
                if not MAGIC.startswith(buf):
                    raise HandshakeError("not a p2pdist peer (bad magic)")
                return None
            if not buf.startswith(MAGIC):
                if buf.startswith(MAGIC[:4]):
                    raise HandshakeError(f"unsupported handshake version {buf[4]}")
                raise HandshakeError("not a p2pdist peer (bad magic)")
        off = len(MAGIC) if self.expect_magic else 0
        if len(buf) < off + 4:
            return None
        (n,) = _LEN.unpack_from(buf, off)
        if n > MAX_RECORD:
            raise HandshakeError(f"handshake record of {n} bytes exceeds {MAX_RECORD}")
        if len(buf) < off + 4 + n:
            return None
        body = buf[off + 4 : off + 4 + n]
        del buf[: off + 4 + n]
        self.expect_magic = False
        try:
            rec = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise HandshakeError(f"undecodable handshake record: {exc}") from None
        if not isinstance(rec, dict):
            raise HandshakeError("handshake record must be a map")
        return rec

    def leftover(self) -> bytes:
        """Bytes received after the last record (the first frames, in plaintext mode)."""
        data = bytes(self._buf)
        self._buf.clear()
        return data


def auth_transcript(
    role: bytes, client_id: bytes, server_id: bytes, client_nonce: bytes, server_nonce: bytes
) -> bytes:
    """The bytes a side signs to prove its key in plaintext mode (role b"C" or b"S")."""
    return b"p2pdist/v1/plain-auth\x00" + role + client_id + server_id + client_nonce + server_nonce


def get_bytes(rec: dict[str, Any], key: str, size: int | None = None) -> bytes:
    """Field ``key`` of a record as bytes of the given size, else HandshakeError."""
    v = rec.get(key)
    if not isinstance(v, bytes) or (size is not None and len(v) != size):
        want = f"{size} bytes" if size is not None else "bytes"
        raise HandshakeError(f"handshake field {key!r} must be {want}")
    return v
