"""Relay protocol codec (sans-I/O): URLs, the HTTP upgrade, frames and the auth proof.

A client reaches the relay over TCP + TLS, asks for an HTTP/1.1 upgrade to
``p2pdist-relay`` (so the connection passes HTTP proxies and shares the HTTPS port with
``/health`` and ``/metrics``), then both sides exchange frames::

    type u8 | length u32 big-endian | body (length bytes, at most MAX_BODY)

The full byte layouts are in docs/protocol.md ("Relay protocol").
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import ipaddress
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

import msgpack

from ..errors import UsageError
from ..identity import ID_LEN, EndpointId
from .frames import fill_buffers
from .websocket import accept_for

__all__ = [
    "BAD_SIGNATURE_TEXT",
    "BAD_TOKEN_TEXT",
    "CREDENTIAL_REFUSALS",
    "MALFORMED_AUTH_TEXT",
    "MAX_BODY",
    "MAX_KEEPALIVE",
    "MAX_RETRY_AFTER",
    "MAX_TOKEN_BYTES",
    "NAME_BOUND",
    "NOT_ALLOWED_TEXT",
    "RECORDS_HEADER",
    "RECORDS_INFO",
    "RECORDS_MAX",
    "REPLACED_TEXT",
    "RelayFrame",
    "RelayFrameDecoder",
    "RelayFrameReader",
    "RelayFrameSplitter",
    "RelayFrameType",
    "RelayProtocolError",
    "RelayUrl",
    "append_addressed",
    "ascii_host",
    "auth_message",
    "challenge_body",
    "decode_addressed",
    "encode_addressed",
    "encode_frame",
    "name_auth_message",
    "parse_challenge",
    "parse_http_head",
    "proof_message",
    "relay_name",
    "records_key",
    "FRAME_HEADER",
    "upgrade_request",
    "upgrade_response",
    "WEBSOCKET_VERSION",
]

VERSION = 1
UPGRADE_TOKEN = "p2pdist-relay"
UPGRADE_PATH = "/relay"
MAX_BODY = 64 * 1024
"""Largest frame body; a datagram may use MAX_BODY - 32 bytes."""
MAX_DATAGRAM = MAX_BODY - ID_LEN
PING_LEN = 8
"""Bytes in a PING's body (the PONG echoes them); other lengths are protocol errors."""
MAX_HTTP_HEAD = 8 * 1024
MAX_KEEPALIVE = 300.0
"""Longest keepalive interval (seconds) a relay may advertise in AUTH_OK: clients take
a longer one for a bad value (and ping every 3 s), so the relay refuses to start with it."""
MAX_RETRY_AFTER = 60.0
"""Longest ``retry_after`` (seconds) a RECONNECT asks for that clients honour (a longer
one is taken as this), so the relay refuses to start with one past it."""

MIN_READ = 16 * 1024
"""The least a relay reads from a rate-limited client at a time once it may be read
again: it stops reading the client until its bucket holds that much, or for at most its
keepalive (docs/protocol.md 8.5). At a low rate the client's PINGs wait unread that long,
which its silence check allows for."""

# ERROR texts answering AUTH (docs/protocol.md, the table of reasons). The first four
# say the client is not let in; the others are a busy relay's, worth retrying.
BAD_SIGNATURE_TEXT = "bad signature"
MALFORMED_AUTH_TEXT = "malformed AUTH"
BAD_TOKEN_TEXT = "bad token"
NOT_ALLOWED_TEXT = "endpoint not allowed"
CREDENTIAL_REFUSALS = {
    BAD_SIGNATURE_TEXT: "bad_signature",
    MALFORMED_AUTH_TEXT: "malformed",
    BAD_TOKEN_TEXT: "bad_token",
    NOT_ALLOWED_TEXT: "not_allowed",
}
"""ERROR answers to AUTH about the client's key, token or place on the allowlist, each
with the short name a client reports it by (``RelayStatus.refusal``; the relay's
metrics use the same names)."""
MAX_TOKEN_BYTES = 1024
"""Longest access token (UTF-8 bytes) an AUTH frame may carry."""
REPLACED_TEXT = "replaced by a newer connection from the same endpoint"
"""ERROR to a connection the relay closes because a newer one authenticated the same
endpoint id (docs/protocol.md 8.4, "Same id twice")."""
_HEAD = struct.Struct(">BI")
FRAME_HEADER = _HEAD.size
"""Bytes in front of every frame's body (kind u8, length u32)."""


class RelayProtocolError(ValueError):
    """Bytes that break the relay protocol (the glue closes that connection).

    ``frames``: the good frames read before the bad bytes in the same read (the reader
    hands them over with the error, so a relay's ERROR or RECONNECT just before garbage
    is still seen)."""

    def __init__(self, message: str, frames: list[RelayFrame] | None = None) -> None:
        super().__init__(message)
        self.frames: list[RelayFrame] = frames if frames is not None else []


class RelayFrameType(enum.IntEnum):
    """Relay frame types (see docs/protocol.md)."""

    CHALLENGE = 0x01  # relay -> client: version u8 | challenge 32
    AUTH = 0x02  # client -> relay: id 32 | signature 64 | token (rest, utf-8)
    AUTH_OK = 0x03  # relay -> client: msgpack map (observed address, limits)
    ERROR = 0x04  # relay -> client: utf-8 reason; the relay closes afterwards
    SEND = 0x10  # client -> relay: destination id 32 | datagram
    RECV = 0x11  # relay -> client: source id 32 | datagram
    PEER_GONE = 0x12  # relay -> client: id 32 (the destination is not connected)
    PING = 0x20  # either way: 8 opaque bytes
    PONG = 0x21  # answer to PING: the same 8 bytes
    RECONNECT = 0x30  # relay -> client: msgpack {"reason": str, "retry_after": float}


Buffer = bytes | bytearray | memoryview


def _head(kind: RelayFrameType, length: int) -> bytes:
    if length > MAX_BODY:
        raise ValueError(f"relay frame body of {length} bytes exceeds {MAX_BODY}")
    return _HEAD.pack(int(kind), length)


def encode_frame(kind: RelayFrameType, body: Buffer = b"") -> bytes:
    """One frame; raises ValueError when ``body`` is over MAX_BODY."""
    return _head(kind, len(body)) + body  # bytes + any buffer: one copy


def encode_addressed(kind: RelayFrameType, peer: EndpointId | bytes, datagram: Buffer) -> bytes:
    """A SEND (to ``peer``) or RECV (from ``peer``) frame carrying ``datagram`` (copied once)."""
    pid = bytes(peer)
    return b"".join((_head(kind, len(pid) + len(datagram)), pid, datagram))


def append_addressed(out: bytearray, kind: RelayFrameType, peer: bytes, datagram: Buffer) -> None:
    """Append a SEND or RECV frame to ``out`` (the datagram is copied once, into ``out``)."""
    out += _head(kind, len(peer) + len(datagram))
    out += peer
    out += datagram


def decode_addressed(body: bytes) -> tuple[bytes, bytes]:
    """(peer id bytes, datagram) of a SEND or RECV body."""
    if len(body) < ID_LEN:
        raise RelayProtocolError("addressed frame shorter than an endpoint id")
    return body[:ID_LEN], body[ID_LEN:]


_KINDS = {int(k): k for k in RelayFrameType}
"""Frame type by its byte (a dict lookup per frame instead of an enum construction)."""


def _header_error(kind_raw: int, length: int, max_body: int) -> RelayProtocolError:
    """What is wrong with a frame header whose type is unknown or whose body is too long."""
    if kind_raw not in _KINDS:
        return RelayProtocolError(f"unknown relay frame type {kind_raw:#x}")
    return RelayProtocolError(f"relay frame of {length} bytes exceeds {max_body}")


def _header(buf: Buffer, start: int, max_body: int) -> tuple[RelayFrameType, int]:
    """The kind and body length of the frame whose header starts at ``buf[start]`` (a
    whole header must be there); RelayProtocolError for a bad one."""
    kind_raw, length = _HEAD.unpack_from(buf, start)
    kind = _KINDS.get(kind_raw)
    if kind is None or length > max_body:
        raise _header_error(kind_raw, length, max_body)
    return kind, length


class RelayFrameDecoder:
    """Incremental frame parser with a hard size limit (its buffer grows only as far as
    the bytes it is fed: the relay holds one per client)."""

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self._buf = bytearray()
        self._max = max_body
        self._failure: str | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[RelayFrameType, bytes]]:
        """Add received bytes; return every complete frame. Bad bytes raise
        RelayProtocolError with the complete frames before them in ``frames`` (a relay's
        ERROR before its garbage still tells why); after it the decoder refuses
        everything."""
        if self._failure is not None:
            raise RelayProtocolError(self._failure)
        self._buf += data
        out: list[tuple[RelayFrameType, bytes]] = []
        start = 0
        buf = self._buf
        try:
            with memoryview(buf) as view:  # released before ``del`` resizes the buffer
                while len(buf) - start >= _HEAD.size:
                    kind, length = _header(buf, start, self._max)
                    end = start + _HEAD.size + length
                    if end > len(buf):
                        break
                    out.append((kind, bytes(view[start + _HEAD.size : end])))  # one copy
                    start = end
        except RelayProtocolError as exc:
            self._failure = str(exc)
            buf.clear()
            # (as RelayFrames: this decoder checks no ids, so a short one is kept whole)
            frames = [_frame(k, b, strict=False) for k, b in out]
            raise RelayProtocolError(self._failure, frames) from None
        del buf[:start]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)


class RelayFrameSplitter:
    """Frames parsed in place from each buffer the caller received into, for a server
    that reads every connection into one shared scratch buffer.

    Complete frames are yielded as views of the caller's buffer, so nothing is copied;
    only the bytes of an incomplete trailing frame are, into a buffer of this splitter's
    own that holds at most one frame and is let go as soon as that frame completes (so
    an idle connection holds no buffer). Same frames, same limit and same errors as
    :class:`RelayFrameDecoder` fed the same bytes; after a RelayProtocolError the
    splitter refuses everything.
    """

    __slots__ = ("_failure", "_partial", "max_body")

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self.max_body = max_body
        """Longest body accepted; may change between frames (a server raises it once a
        client has authenticated), and the next header is checked against the new value."""
        self._partial = bytearray()
        self._failure: str | None = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._partial)

    def frames(self, data: Buffer) -> Iterator[tuple[RelayFrameType, memoryview]]:
        """Every frame that ``data`` completes, in order. A body is a view that is valid
        only until the next frame is asked for, and only while ``data`` is unchanged:
        copy what must outlive that. Stopping early drops the rest of ``data``."""
        if self._failure is not None:
            raise RelayProtocolError(self._failure)
        with memoryview(data) as whole, whole.cast("B") as view:
            try:
                start = 0
                if self._partial:
                    start, frame = self._complete(view)
                    if frame is not None:
                        yield frame
                end, unpack, kinds = len(view), _HEAD.unpack_from, _KINDS
                while end - start >= FRAME_HEADER:
                    kind_raw, length = unpack(view, start)  # _header, inlined: hot loop
                    kind = kinds.get(kind_raw)
                    if kind is None or length > self.max_body:
                        raise _header_error(kind_raw, length, self.max_body)
                    stop = start + FRAME_HEADER + length
                    if stop > end:
                        break
                    yield kind, view[start + FRAME_HEADER : stop]
                    start = stop
                if start < end:
                    self._partial = bytearray(view[start:])  # the one copy: a frame's head
            except RelayProtocolError as exc:
                self._failure = str(exc)
                raise

    def _complete(self, view: memoryview) -> tuple[int, tuple[RelayFrameType, memoryview] | None]:
        """Move the bytes that continue the held frame out of ``view``: (bytes used, the
        frame if now complete)."""
        partial = self._partial
        used = 0
        if len(partial) < FRAME_HEADER:
            used = min(FRAME_HEADER - len(partial), len(view))
            partial += view[:used]
            if len(partial) < FRAME_HEADER:
                return used, None
        kind, length = _header(partial, 0, self.max_body)
        take = min(FRAME_HEADER + length - len(partial), len(view) - used)
        partial += view[used : used + take]
        used += take
        if len(partial) < FRAME_HEADER + length:
            return used, None
        # A new buffer rather than clearing this one: the caller may still hold the
        # body's view, and a buffer with views cannot be resized.
        self._partial = bytearray()
        return used, (kind, memoryview(partial)[FRAME_HEADER:])


class RelayFrame(NamedTuple):
    """One frame as :class:`RelayFrameReader` delivers it."""

    kind: RelayFrameType
    peer: bytes
    """SEND and RECV: the endpoint id in front of the datagram; other kinds: empty."""
    body: bytes
    """SEND and RECV: the datagram alone; other kinds: the whole body."""


_ADDRESSED = frozenset({RelayFrameType.SEND, RelayFrameType.RECV})


def _frame(
    kind: RelayFrameType, body: bytes | bytearray | memoryview, *, strict: bool = True
) -> RelayFrame:
    """A decoded frame with its peer id split off (SEND and RECV). One too short to
    hold an id is a RelayProtocolError, or with ``strict=False`` kept whole (no peer)."""
    if kind not in _ADDRESSED or (len(body) < ID_LEN and not strict):
        return RelayFrame(kind, b"", bytes(body))
    if len(body) < ID_LEN:
        raise RelayProtocolError("addressed frame shorter than an endpoint id")
    return RelayFrame(kind, bytes(body[:ID_LEN]), bytes(body[ID_LEN:]))


class RelayFrameReader:
    """Frames received in place: for an ``asyncio.BufferedProtocol``, whose transport
    writes (or TLS decrypts) straight into :meth:`get_buffer`. A
    :class:`RelayFrameSplitter` parses them there; every datagram is then copied once,
    out of the buffer into its own bytes.

    One fixed buffer of ``capacity`` bytes (at least two largest frames), for the one
    session a client holds; the relay, with a session per client, shares one scratch
    buffer between all of them and uses a splitter directly.
    """

    def __init__(self, max_body: int = MAX_BODY, capacity: int = 256 * 1024) -> None:
        self._splitter = RelayFrameSplitter(max_body)
        self._buf = bytearray(max(capacity, 2 * (_HEAD.size + max_body)))
        self._failure: str | None = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return self._splitter.pending

    def get_buffer(self) -> memoryview:
        """Where the next received bytes go (room for at least one largest frame)."""
        return memoryview(self._buf)

    def buffer_updated(self, nbytes: int) -> list[RelayFrame]:
        """Account for ``nbytes`` written into the last buffer; return the complete frames.
        After a RelayProtocolError the reader refuses everything (the connection is bad)."""
        if self._failure is not None:
            raise RelayProtocolError(self._failure)
        out: list[RelayFrame] = []
        try:
            with memoryview(self._buf) as whole, whole[:nbytes] as data:
                for kind, body in self._splitter.frames(data):
                    out.append(_frame(kind, body))
        except RelayProtocolError as exc:
            self._failure = str(exc)
            raise RelayProtocolError(self._failure, out) from None  # with the good frames
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[RelayFrame]:
        """Push bytes that arrived some other way (for tests, and bytes read before). A
        RelayProtocolError carries every good frame before the bad bytes, also those of
        earlier buffers of the same call."""
        out: list[RelayFrame] = []
        try:
            for n in fill_buffers(self.get_buffer, data):
                out += self.buffer_updated(n)
        except RelayProtocolError as exc:
            exc.frames[:0] = out
            raise
        return out


def auth_message(cert_sha256: bytes, challenge: bytes, client_id: bytes) -> bytes:
    """What a client signs to authenticate: bound to the relay's TLS certificate (as the
    client saw it) and the relay's fresh challenge, so a proof can neither be replayed nor
    forwarded to another relay."""
    if len(cert_sha256) != 32 or len(challenge) != 32 or len(client_id) != ID_LEN:
        raise ValueError("auth_message needs 32-byte hash, challenge and id")
    return b"p2pdist/v1/relay-auth\x00" + cert_sha256 + challenge + client_id


NAME_BOUND = 1
"""The CHALLENGE's last byte when the relay asks for a proof bound to its name
(:func:`name_auth_message`), not to the certificate the client sees."""


_BOUND = bytes([NAME_BOUND])


def challenge_body(challenge: bytes, *, name_bound: bool = False) -> bytes:
    """A CHALLENGE frame's body: the version, the fresh ``challenge`` and, when the
    proof must be bound to the relay's name, :data:`NAME_BOUND`."""
    if len(challenge) != 32:
        raise ValueError("a challenge is 32 bytes")
    return bytes([VERSION]) + challenge + (_BOUND if name_bound else b"")


def parse_challenge(body: bytes) -> tuple[bytes, bool]:
    """A CHALLENGE body's challenge and whether the proof is to be bound to the relay's
    name; RelayProtocolError for any other form."""
    if len(body) not in (33, 34) or body[0] != VERSION or body[33:] not in (b"", _BOUND):
        raise RelayProtocolError(f"relay did not send a version-{VERSION} challenge")
    return body[1:33], len(body) == 34


def relay_name(host: str, port: int) -> bytes:
    """A relay's name as a name-bound proof names it: ``host:port`` in lower case, a
    non-ASCII name in its IDNA form, without a trailing dot, an IP address in its
    compressed form (IPv6 bracketed), the port always written. UsageError for a host
    without an ASCII form."""
    host = ascii_host(host).lower().removesuffix(".")
    with contextlib.suppress(ValueError):
        host = ipaddress.ip_address(host).compressed
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}".encode("ascii")


def name_auth_message(name: bytes, challenge: bytes, client_id: bytes) -> bytes:
    """What a client signs for a relay behind a TLS-terminating proxy or load balancer
    with certificates of its own (which the relay cannot know): bound to the relay's
    name (:func:`relay_name`, as the client dialed it) instead of the certificate, and
    to the fresh challenge. A proof made for one relay still names that relay only;
    docs/security.md says what this binding gives up."""
    if not 0 < len(name) <= 0xFFFF or len(challenge) != 32 or len(client_id) != ID_LEN:
        raise ValueError("name_auth_message needs a name, a 32-byte challenge and an id")
    return (
        b"p2pdist/v1/relay-auth-name\x00"
        + len(name).to_bytes(2, "big")
        + name
        + challenge
        + client_id
    )


def proof_message(
    url: RelayUrl, cert_sha256: bytes, challenge: bytes, client_id: bytes, *, name_bound: bool
) -> bytes:
    """What a client that dialed ``url`` and was shown the certificate of SHA-256
    ``cert_sha256`` signs for ``challenge``: bound to the relay's name when the CHALLENGE
    asked for that (:func:`name_auth_message`), else to the certificate
    (:func:`auth_message`). A client refuses the former for a pinned ``url`` before it
    gets here (a pin reaches the relay's own TLS, where the certificate binds)."""
    if name_bound:
        return name_auth_message(relay_name(url.host, url.port), challenge, client_id)
    return auth_message(cert_sha256, challenge, client_id)


def cert_fingerprint(cert_der: bytes) -> bytes:
    """SHA-256 of a DER certificate (what :func:`auth_message` binds to)."""
    return hashlib.sha256(cert_der).digest()


def encode_map(fields: dict[str, Any]) -> bytes:
    """msgpack body for AUTH_OK and RECONNECT."""
    return bytes(msgpack.packb(fields, use_bin_type=True))


def decode_map(body: bytes) -> dict[str, Any]:
    """Parse a msgpack map body; RelayProtocolError when it is not one."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RelayProtocolError(f"undecodable relay control body: {exc}") from None
    if not isinstance(obj, dict):
        raise RelayProtocolError("relay control body must be a map")
    return obj


# ---- HTTP upgrade --------------------------------------------------------------------


RECORDS_HEADER = "P2pdist-Relay-Records"
"""The upgrade's header that offers (request) and takes (101) AES-GCM records after it:
``aes-256-gcm; key=<64 hex digits>``, the sender's record secret (docs/protocol.md 8.2)."""
RECORDS_INFO = b"p2pdist relay records v1 aes-256-gcm"
"""The protocol name in the records' key derivation (the client is the dialer)."""
RECORDS_MAX = 64 * 1024
"""Largest plaintext of one relay record, either way (a longer one ends the connection):
small enough that a receiver decrypts whole records straight into its frame buffer, and
that a client cannot make the relay hold more than this for one of its records."""
WEBSOCKET_VERSION = 13
"""The ``Sec-WebSocket-Version`` of RFC 6455."""
_RECORDS_CIPHER = "aes-256-gcm"
_HEX_KEY = re.compile("[0-9a-fA-F]{64}")


def _records_header(secret: bytes | None) -> str:
    if secret is None:
        return ""
    if len(secret) != 32:
        raise ValueError("a record secret is 32 bytes")
    return f"{RECORDS_HEADER}: {_RECORDS_CIPHER}; key={secret.hex()}\r\n"


def _upgrade_headers(websocket: str | None, accept: bool) -> str:
    if websocket is None:
        return f"Upgrade: {UPGRADE_TOKEN}\r\n"
    key = (
        f"Sec-WebSocket-Accept: {accept_for(websocket)}"
        if accept
        else (f"Sec-WebSocket-Key: {websocket}\r\nSec-WebSocket-Version: {WEBSOCKET_VERSION}")
    )
    return f"Upgrade: websocket\r\n{key}\r\nSec-WebSocket-Protocol: {UPGRADE_TOKEN}\r\n"


def upgrade_request(
    host: str, records_secret: bytes | None = None, websocket_key: str | None = None
) -> bytes:
    """The client's HTTP/1.1 upgrade request (offering records under its
    ``records_secret`` when given): a WebSocket opening handshake with
    ``websocket_key`` (``Sec-WebSocket-Key``), else ``Upgrade: p2pdist-relay``.
    ``host``: the ``Host`` field (:attr:`RelayUrl.authority`)."""
    return (
        f"GET {UPGRADE_PATH} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\n"
        f"{_upgrade_headers(websocket_key, False)}P2pdist-Relay-Version: {VERSION}\r\n"
        f"{_records_header(records_secret)}\r\n"
    ).encode("ascii")


def upgrade_response(
    records_secret: bytes | None = None, websocket_key: str | None = None
) -> bytes:
    """The relay's 101 answer (taking the offered records, under its
    ``records_secret``, when given), to a WebSocket handshake with the client's
    ``websocket_key`` when given."""
    return (
        f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
        f"{_upgrade_headers(websocket_key, True)}{_records_header(records_secret)}\r\n"
    ).encode("ascii")


def records_key(head: HttpHead) -> bytes | None:
    """The record secret a request offers or a 101 takes: None without the header or
    for a cipher other than aes-256-gcm (an offer we cannot take is declined, not an
    error). RelayProtocolError for an aes-256-gcm offer without a 32-byte hex key."""
    value = head.header(RECORDS_HEADER)
    if not value:
        return None
    cipher, _, params = value.partition(";")
    if cipher.strip().lower() != _RECORDS_CIPHER:
        return None
    name, _, key = params.strip().partition("=")
    key = key.strip()
    if name.strip().lower() != "key" or not _HEX_KEY.fullmatch(key):
        raise RelayProtocolError(f"malformed {RECORDS_HEADER} header {value[:100]!r}")
    return bytes.fromhex(key)


@dataclass(frozen=True, slots=True)
class HttpHead:
    """A parsed request or status line plus headers (names lower-cased; a list field on
    several lines is one value, joined by ", ")."""

    start_line: list[str]
    headers: dict[str, str]

    def header(self, name: str) -> str:
        """Header value or ''."""
        return self.headers.get(name.lower(), "")


_SINGLE_HEADERS = frozenset(
    {
        "host",
        "upgrade",
        "connection",
        "authorization",
        "content-length",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-accept",
        "p2pdist-relay-version",
        RECORDS_HEADER.lower(),
    }
)
"""Header fields a request or answer may carry once (a repeat is refused, not
resolved): the upgrade's own fields and every single value the relay protocol reads."""
_LIST_HEADERS = frozenset({"x-forwarded-for", "sec-websocket-protocol", "sec-websocket-extensions"})
"""Comma-separated list fields: repeated lines are one list, in order (RFC 9110 5.3; a
proxy may add its own X-Forwarded-For line after the client's). Other repeats: the last
line counts."""


def parse_http_head(buf: bytes | bytearray) -> tuple[HttpHead, int] | None:
    """Parse an HTTP/1.1 head from the start of ``buf``; returns (head, bytes used), or
    None when more bytes are needed. RelayProtocolError for malformed or oversized heads."""
    end = bytes(buf[: MAX_HTTP_HEAD + 4]).find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HTTP_HEAD:
            raise RelayProtocolError("HTTP head too large")
        return None
    try:
        text = bytes(buf[:end]).decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes everything
        raise RelayProtocolError("undecodable HTTP head") from None
    lines = text.split("\r\n")
    for line in lines:
        # RFC 9112 5.5: CR, LF and NUL in a field value are refused. A proxy in front of
        # us may take a bare LF for a line end (RFC 9112 2.2) and read one line more.
        if "\r" in line or "\n" in line or "\x00" in line:
            raise RelayProtocolError(f"CR, LF or NUL inside an HTTP line {line[:80]!r}")
    start = lines[0].split(" ", 2)
    if len(start) < 2:
        raise RelayProtocolError(f"malformed HTTP start line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        # RFC 9112 section 5: no whitespace in or around a field name (a line that starts
        # with it is an obsolete continuation), and the upgrade's own fields only once:
        # a proxy in front of us must not read another request than we do.
        if not sep or not name or name != name.strip() or " " in name or "\t" in name:
            raise RelayProtocolError(f"malformed HTTP header {line[:80]!r}")
        key = name.lower()
        if key in headers and key in _SINGLE_HEADERS:
            raise RelayProtocolError(f"repeated HTTP header {name[:80]!r}")
        if key in headers and key in _LIST_HEADERS:
            headers[key] = f"{headers[key]}, {value.strip()}"
        else:
            headers[key] = value.strip()
    return HttpHead(start, headers), end + 4


# ---- URLs ------------------------------------------------------------------------------

_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def ascii_host(host: str) -> str:
    """``host`` as TLS (SNI), DNS and HTTP ``Host`` fields carry it: IDNA for a
    non-ASCII name. UsageError for a name without that form, or with characters no host
    name has (an IP address passes as it is)."""
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise UsageError(f"relay host {host!r} has no IDNA (ASCII) form") from None
    if ":" not in host and not _HOST_NAME.fullmatch(host):
        raise UsageError(f"relay host {host!r} is not a host name or IP address")
    return host


@dataclass(frozen=True, slots=True)
class RelayUrl:
    """Where a relay is and how to trust it.

    ``https://host:port`` trusts the relay's certificate through the system CAs;
    ``https://host:port/?pin=<endpoint id>`` trusts exactly the relay's own Ed25519 key
    (a self-hosted relay without a CA). Verification is never switched off.
    """

    host: str
    port: int
    pin: EndpointId | None

    @classmethod
    def parse(cls, url: str) -> RelayUrl:
        """Parse and validate; UsageError says what is wrong."""
        if not isinstance(url, str):
            raise UsageError(f"relay URL must be a string, got {type(url).__name__}")
        try:
            parts = urlsplit(url.strip())
        except ValueError as exc:  # e.g. "[name]" in brackets: not an IPv6 address
            raise UsageError(f"relay URL {url!r}: {exc}") from None
        if parts.scheme != "https":
            raise UsageError(f"relay URL must start with https://, got {url!r}")
        if not parts.hostname:
            raise UsageError(f"relay URL {url!r} has no host")
        if parts.username is not None or parts.password is not None:
            # A token there would silently go nowhere: the relay takes it in AUTH.
            raise UsageError(f"relay URL {url!r}: no user or password (pass a token apart)")
        if parts.path not in ("", "/") or parts.fragment:
            raise UsageError(f"relay URL {url!r}: no path or fragment (only /?pin=...)")
        if "%" in parts.hostname:
            raise UsageError(f"relay URL {url!r}: an IPv6 zone id is not supported")
        try:
            port = parts.port
        except ValueError:
            raise UsageError(f"relay URL {url!r} has a bad port") from None
        if port == 0:
            raise UsageError(f"relay URL {url!r} has a bad port")
        # keep_blank_values: "?pin=" (an empty pin) must be refused, not read as no pin.
        query = parse_qs(parts.query, keep_blank_values=True)
        unknown = set(query) - {"pin"}
        if unknown:
            raise UsageError(f"relay URL {url!r}: unknown parameter(s) {sorted(unknown)}")
        pins = query.get("pin", [])
        if len(pins) > 1:
            raise UsageError(f"relay URL {url!r} has more than one pin")
        if pins and not pins[0]:
            raise UsageError(f"relay URL {url!r}: pin needs a value (?pin=<endpoint id>)")
        try:
            pin = EndpointId.parse(pins[0]) if pins else None
        except ValueError as exc:  # UsageError is one: a bad pin, named as the pin
            raise UsageError(f"relay URL pin: {exc}") from None
        return cls(ascii_host(parts.hostname), port or 443, pin)

    @property
    def authority(self) -> str:
        """``host[:port]`` as an HTTP ``Host`` field names the relay (RFC 9110 7.2): an
        IPv6 host bracketed, the port left out when it is HTTPS's 443."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == 443 else f"{host}:{self.port}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        base = f"https://{host}:{self.port}/"
        return base + (f"?pin={self.pin}" if self.pin else "")
