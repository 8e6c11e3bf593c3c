"""Path-discovery messages for hole punching, sans-I/O: PING, PONG and CANDIDATES.

Every message is signed by its sender's endpoint key, over a domain tag, the receiver's
endpoint id and the message itself, so a message can never be taken for one from another
peer, nor replayed to a different receiver. Each side of a punching session makes a fresh
16-byte *session* (its creation time, then random bytes: :func:`new_session`) and
announces it in its CANDIDATES (which travel through the authenticated relay
connection); every PING and PONG carries the receiver's session and the sender's, so a
probe captured in another session is refused, and a PONG carries the transaction id of
the PING it answers. Layout (big endian)::

    magic "\\x1cP2PD" (5) | version u8 = 4 | kind u8 | sender id (32) | body | signature (64)

    PING        body: txid (12) | receiver's session (16) | sender's session (16) | padding
    PONG        body: txid (12) | receiver's session (16) | sender's session (16) | address
                | padding (address: where the PING came from)
    CANDIDATES  body: flags u8 (bit 0: reply wanted) | sender's session (16) | count u8
                | count x address

    address:    family u8 (4 or 6) | port u16 | ip (4 or 16)
    padding:    zero bytes (any number, signed with the rest): a PING is padded to the
                largest datagram QUIC will send on the path it tests, so a path that
                drops large datagrams (a VPN's smaller MTU) never validates; a PONG to
                the size of the PING it answers (never more: no amplification)

The first byte (0x1c) has QUIC's fixed bit (0x40) clear and the fifth byte is not STUN's
magic cookie, so one UDP socket can carry QUIC, STUN and these probes: see
:func:`classify`. PING and PONG travel over UDP; CANDIDATES through the relay.
"""

from __future__ import annotations

import enum
import ipaddress
import secrets
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..identity import ID_LEN, EndpointId, SecretKey, endpoint_id_of
from .stun import MAGIC_COOKIE

__all__ = [
    "MAGIC",
    "MAX_CANDIDATES",
    "SESSION_LEN",
    "TXID_LEN",
    "DatagramKind",
    "ProbeError",
    "ProbeKind",
    "ProbeMessage",
    "check_session",
    "new_session",
    "session_time",
    "classify",
    "decode_probe",
    "encode_candidates",
    "encode_ping",
    "encode_pong",
    "peek_sender",
]

MAGIC = b"\x1cP2PD"
VERSION = 4
"""4: PING and PONG may end in zero padding. 3: sessions start with their creation time
(version 2's were random: a receiver could not tell an older one from a newer one)."""
TXID_LEN = 12
SESSION_LEN = 16
"""Bytes in a punching session id: 8 bytes of its creation time (microseconds since the
epoch, big-endian: a later session of a peer compares higher), then 8 random bytes."""
SIG_LEN = 64
MAX_CANDIDATES = 16
"""Most addresses one CANDIDATES message may carry."""
_DOMAIN = b"p2pdist/v1/probe\x00"
_HEAD = len(MAGIC) + 2 + ID_LEN
_COOKIE = struct.pack(">I", MAGIC_COOKIE)
_TRANSACTION = TXID_LEN + 2 * SESSION_LEN

Address = tuple[str, int]


class ProbeError(ValueError):
    """Not a well-formed probe message, or a bad signature."""


class ProbeKind(enum.IntEnum):
    """The three probe messages."""

    PING = 1
    PONG = 2
    CANDIDATES = 3


class DatagramKind(enum.Enum):
    """What a datagram on a p2pdist UDP socket is."""

    QUIC = "quic"
    STUN = "stun"
    PROBE = "probe"
    GARBAGE = "garbage"


@dataclass(frozen=True, slots=True)
class ProbeMessage:
    """A decoded, signature-checked probe."""

    kind: ProbeKind
    sender: EndpointId
    txid: bytes = b""
    """PING and PONG: the transaction id."""
    to_session: bytes = b""
    """PING and PONG: the receiver's punching session, as the sender knows it."""
    from_session: bytes = b""
    """All kinds: the sender's punching session."""
    address: Address | None = None
    """PONG: where the receiver of the PING saw it come from."""
    candidates: tuple[Address, ...] = ()
    """CANDIDATES: the sender's addresses."""
    reply_wanted: bool = False
    """CANDIDATES: the sender asks for the receiver's candidates in return."""


def classify(data: bytes) -> DatagramKind:
    """Tell QUIC packets, STUN messages and probes on one socket apart (no parsing)."""
    if len(data) >= 20 and data[4:8] == _COOKIE and data[0] < 0x40:
        return DatagramKind.STUN
    if data[:5] == MAGIC:
        return DatagramKind.PROBE
    if data and data[0] & 0x40:
        return DatagramKind.QUIC
    return DatagramKind.GARBAGE


def _encode_address(addr: Address) -> bytes:
    ip = ipaddress.ip_address(addr[0])
    if not 0 < addr[1] < 65536:
        raise ProbeError(f"bad port {addr[1]}")
    return struct.pack(">BH", ip.version, addr[1]) + ip.packed


def _decode_address(data: bytes, off: int) -> tuple[Address, int]:
    if off + 3 > len(data):
        raise ProbeError("truncated address")
    family, port = struct.unpack_from(">BH", data, off)
    size = {4: 4, 6: 16}.get(family)
    if size is None or port == 0:
        raise ProbeError("bad address family or port")
    raw = data[off + 3 : off + 3 + size]
    if len(raw) != size:
        raise ProbeError("truncated address")
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # one name per peer: sockets report it as IPv4
    return (str(ip), port), off + 3 + size


def _seal(key: SecretKey, receiver: EndpointId, kind: ProbeKind, body: bytes) -> bytes:
    msg = MAGIC + bytes((VERSION, kind)) + bytes(key.endpoint_id) + body
    return msg + key.sign(_DOMAIN + bytes(receiver) + msg)


def new_session(now_us: int | None = None) -> bytes:
    """A fresh punching session id: creation time (``now_us``, default the wall clock in
    microseconds), then random bytes; see :data:`SESSION_LEN`."""
    stamp = time.time_ns() // 1000 if now_us is None else now_us
    return (stamp & ((1 << 64) - 1)).to_bytes(8, "big") + secrets.token_bytes(SESSION_LEN - 8)


def session_time(session: bytes) -> int:
    """The creation time a session id carries (what orders a peer's sessions)."""
    return int.from_bytes(session[:8], "big")


def check_session(session: bytes) -> bytes:
    """``session`` when it is :data:`SESSION_LEN` bytes long, else ProbeError (a
    ValueError)."""
    if len(session) != SESSION_LEN:
        raise ProbeError(f"a session is {SESSION_LEN} bytes")
    return session


def _transaction(txid: bytes, to_session: bytes, from_session: bytes) -> bytes:
    if len(txid) != TXID_LEN:
        raise ProbeError(f"a transaction id is {TXID_LEN} bytes")
    return txid + check_session(to_session) + check_session(from_session)


def _padded(body: bytes, size: int) -> bytes:
    """``body`` with zero padding so that its sealed message is ``size`` bytes (no
    padding when it is that long already)."""
    return body + bytes(max(0, size - (_HEAD + len(body) + SIG_LEN)))


def encode_ping(
    key: SecretKey,
    receiver: EndpointId,
    txid: bytes,
    *,
    to_session: bytes,
    from_session: bytes,
    pad_to: int = 0,
) -> bytes:
    """A PING from ``key`` to ``receiver``, within the punching session in which
    ``receiver`` announced ``to_session`` and we announced ``from_session``; padded to
    ``pad_to`` bytes in all."""
    body = _padded(_transaction(txid, to_session, from_session), pad_to)
    return _seal(key, receiver, ProbeKind.PING, body)


def encode_pong(
    key: SecretKey,
    receiver: EndpointId,
    txid: bytes,
    seen_from: Address,
    *,
    to_session: bytes,
    from_session: bytes,
    pad_to: int = 0,
) -> bytes:
    """The answer to ``receiver``'s PING ``txid``, which came from ``seen_from``
    (``to_session``: the PING's sender session; ``from_session``: ours); padded to
    ``pad_to`` bytes in all."""
    body = _transaction(txid, to_session, from_session) + _encode_address(seen_from)
    return _seal(key, receiver, ProbeKind.PONG, _padded(body, pad_to))


def encode_candidates(
    key: SecretKey,
    receiver: EndpointId,
    candidates: Sequence[Address],
    *,
    reply_wanted: bool,
    session: bytes,
) -> bytes:
    """Our candidate addresses for ``receiver`` (at most :data:`MAX_CANDIDATES`), and our
    punching ``session``."""
    if len(candidates) > MAX_CANDIDATES:
        raise ProbeError(f"at most {MAX_CANDIDATES} candidates")
    body = bytes((int(reply_wanted),)) + check_session(session) + bytes((len(candidates),))
    body += b"".join(_encode_address(c) for c in candidates)
    return _seal(key, receiver, ProbeKind.CANDIDATES, body)


def peek_sender(data: bytes) -> EndpointId | None:
    """The claimed (not yet verified) sender of a probe, to decide whether to verify it."""
    if len(data) < _HEAD + SIG_LEN or data[:5] != MAGIC:
        return None
    try:
        return endpoint_id_of(data[len(MAGIC) + 2 : _HEAD])
    except ValueError:
        return None


def decode_probe(data: bytes, receiver: EndpointId) -> ProbeMessage:
    """Parse a probe addressed to ``receiver`` and check its signature (ProbeError if bad)."""
    if len(data) < _HEAD + SIG_LEN or data[:5] != MAGIC:
        raise ProbeError("not a probe")
    if data[5] != VERSION:
        raise ProbeError(f"unknown probe version {data[5]}")
    try:
        kind = ProbeKind(data[6])
    except ValueError:
        raise ProbeError(f"unknown probe kind {data[6]}") from None
    sender = peek_sender(data)
    if sender is None:
        raise ProbeError("bad sender id")
    msg, sig = data[:-SIG_LEN], data[-SIG_LEN:]
    if not sender.verify(sig, _DOMAIN + bytes(receiver) + msg):
        raise ProbeError(f"bad signature (claimed sender {sender.short()})")
    body = msg[_HEAD:]
    if kind is ProbeKind.CANDIDATES:
        return _decode_candidates(sender, body)
    if len(body) < _TRANSACTION:
        raise ProbeError(f"truncated {kind.name}")
    txid, to_session, from_session = (
        body[:TXID_LEN],
        body[TXID_LEN : TXID_LEN + SESSION_LEN],
        body[TXID_LEN + SESSION_LEN : _TRANSACTION],
    )
    if kind is ProbeKind.PING:
        if not _zeros(body, _TRANSACTION):
            raise ProbeError("trailing bytes in PING")
        return ProbeMessage(kind, sender, txid, to_session, from_session)
    addr, end = _decode_address(body, _TRANSACTION)
    if not _zeros(body, end):
        raise ProbeError("trailing bytes in PONG")
    return ProbeMessage(kind, sender, txid, to_session, from_session, address=addr)


def _zeros(body: bytes, start: int) -> bool:
    """Whether ``body`` from ``start`` on is padding (zero bytes only, or nothing)."""
    return body.count(0, start) == len(body) - start


def _decode_candidates(sender: EndpointId, body: bytes) -> ProbeMessage:
    head = 2 + SESSION_LEN
    if len(body) < head or body[head - 1] > MAX_CANDIDATES or body[0] & ~1:
        raise ProbeError("bad CANDIDATES header")
    off, found = head, []
    for _ in range(body[head - 1]):
        addr, off = _decode_address(body, off)
        found.append(addr)
    if off != len(body):
        raise ProbeError("trailing bytes in CANDIDATES")
    return ProbeMessage(
        ProbeKind.CANDIDATES,
        sender,
        from_session=body[1 : 1 + SESSION_LEN],
        candidates=tuple(found),
        reply_wanted=bool(body[0] & 1),
    )
