"""Path-discovery messages for hole punching, sans-I/O: PING, PONG and CANDIDATES.

Every message is signed by its sender's endpoint key, over a domain tag, the receiver's
endpoint id and the message itself, so a message can never be taken for one from another
peer, nor replayed to a different receiver; PONG and PING carry a fresh random
transaction id, so an old PONG validates nothing. Layout (big endian)::

    magic "\\x1cP2PD" (5) | version u8 = 1 | kind u8 | sender id (32) | body | signature (64)

    PING        body: txid (12)
    PONG        body: txid (12) | address (where the PING came from)
    CANDIDATES  body: flags u8 (bit 0: reply wanted) | count u8 | count x address

    address:    family u8 (4 or 6) | port u16 | ip (4 or 16)

The first byte (0x1c) has QUIC's fixed bit (0x40) clear and the fifth byte is not STUN's
magic cookie, so one UDP socket can carry QUIC, STUN and these probes: see
:func:`classify`. PING and PONG travel over UDP; CANDIDATES through the relay.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..identity import ID_LEN, EndpointId, SecretKey, endpoint_id_of
from .stun import MAGIC_COOKIE

__all__ = [
    "MAGIC",
    "MAX_CANDIDATES",
    "DatagramKind",
    "ProbeError",
    "ProbeKind",
    "ProbeMessage",
    "classify",
    "decode_probe",
    "encode_candidates",
    "encode_ping",
    "encode_pong",
    "peek_sender",
]

MAGIC = b"\x1cP2PD"
VERSION = 1
TXID_LEN = 12
SIG_LEN = 64
MAX_CANDIDATES = 16
"""Most addresses one CANDIDATES message may carry."""
_DOMAIN = b"p2pdist/v1/probe\x00"
_HEAD = len(MAGIC) + 2 + ID_LEN
_COOKIE = struct.pack(">I", MAGIC_COOKIE)

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
    return (str(ipaddress.ip_address(raw)), port), off + 3 + size


def _seal(key: SecretKey, receiver: EndpointId, kind: ProbeKind, body: bytes) -> bytes:
    msg = MAGIC + bytes((VERSION, kind)) + bytes(key.endpoint_id) + body
    return msg + key.sign(_DOMAIN + bytes(receiver) + msg)


def encode_ping(key: SecretKey, receiver: EndpointId, txid: bytes) -> bytes:
    """A PING from ``key`` to ``receiver``."""
    if len(txid) != TXID_LEN:
        raise ProbeError(f"a transaction id is {TXID_LEN} bytes")
    return _seal(key, receiver, ProbeKind.PING, txid)


def encode_pong(key: SecretKey, receiver: EndpointId, txid: bytes, seen_from: Address) -> bytes:
    """The answer to ``receiver``'s PING ``txid``, which came from ``seen_from``."""
    if len(txid) != TXID_LEN:
        raise ProbeError(f"a transaction id is {TXID_LEN} bytes")
    return _seal(key, receiver, ProbeKind.PONG, txid + _encode_address(seen_from))


def encode_candidates(
    key: SecretKey, receiver: EndpointId, candidates: Sequence[Address], *, reply_wanted: bool
) -> bytes:
    """Our candidate addresses for ``receiver`` (at most :data:`MAX_CANDIDATES`)."""
    if len(candidates) > MAX_CANDIDATES:
        raise ProbeError(f"at most {MAX_CANDIDATES} candidates")
    body = bytes((int(reply_wanted), len(candidates)))
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
    if kind is ProbeKind.PING:
        if len(body) != TXID_LEN:
            raise ProbeError("PING body is a transaction id")
        return ProbeMessage(kind, sender, txid=body)
    if kind is ProbeKind.PONG:
        addr, end = _decode_address(body, TXID_LEN)
        if end != len(body):
            raise ProbeError("trailing bytes in PONG")
        return ProbeMessage(kind, sender, txid=body[:TXID_LEN], address=addr)
    if len(body) < 2 or body[1] > MAX_CANDIDATES or body[0] & ~1:
        raise ProbeError("bad CANDIDATES header")
    off, found = 2, []
    for _ in range(body[1]):
        addr, off = _decode_address(body, off)
        found.append(addr)
    if off != len(body):
        raise ProbeError("trailing bytes in CANDIDATES")
    return ProbeMessage(kind, sender, candidates=tuple(found), reply_wanted=bool(body[0] & 1))
