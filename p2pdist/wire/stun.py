"""STUN Binding (RFC 8489) for address observation, sans-I/O.

Only what p2pdist needs: a client asks "what ip:port do you see me at?" with a Binding
Request; the relay's UDP observation port answers with a Binding Success Response that
carries XOR-MAPPED-ADDRESS. Standard STUN tools can query a p2pdist relay, too.
"""

from __future__ import annotations

import ipaddress
import secrets
import struct

__all__ = [
    "StunError",
    "binding_request",
    "binding_response",
    "new_transaction_id",
    "parse_binding_request",
    "parse_binding_response",
]

MAGIC_COOKIE = 0x2112A442
BINDING_REQUEST = 0x0001
BINDING_SUCCESS = 0x0101
XOR_MAPPED_ADDRESS = 0x0020
_HEADER = struct.Struct(">HHI12s")
_MAX_MESSAGE = 1024


class StunError(ValueError):
    """Not a well-formed STUN message of the kind expected."""


def new_transaction_id() -> bytes:
    """A fresh random 96-bit transaction id."""
    return secrets.token_bytes(12)


def binding_request(txid: bytes) -> bytes:
    """A Binding Request with no attributes."""
    if len(txid) != 12:
        raise ValueError("STUN transaction id is 12 bytes")
    return _HEADER.pack(BINDING_REQUEST, 0, MAGIC_COOKIE, txid)


def _header(data: bytes) -> tuple[int, int, bytes]:
    if len(data) < _HEADER.size or len(data) > _MAX_MESSAGE:
        raise StunError("wrong size for a STUN message")
    mtype, length, cookie, txid = _HEADER.unpack_from(data)
    if mtype & 0xC000 or cookie != MAGIC_COOKIE:
        raise StunError("not a STUN message (bad type bits or magic cookie)")
    if length % 4 or _HEADER.size + length != len(data):
        raise StunError("STUN length field does not match the message")
    return mtype, length, txid


def parse_binding_request(data: bytes) -> bytes:
    """The transaction id of a Binding Request; StunError for anything else."""
    mtype, _, txid = _header(data)
    if mtype != BINDING_REQUEST:
        raise StunError(f"STUN message type {mtype:#06x} is not a Binding Request")
    return bytes(txid)


def binding_response(txid: bytes, ip: str, port: int) -> bytes:
    """A Binding Success Response telling the client it was seen at ``ip:port``."""
    addr = ipaddress.ip_address(ip)
    xport = port ^ (MAGIC_COOKIE >> 16)
    if addr.version == 4:
        xaddr = int(addr) ^ MAGIC_COOKIE
        value = struct.pack(">BBHI", 0, 0x01, xport, xaddr)
    else:
        xaddr6 = (int(addr) ^ _v6_mask(txid)).to_bytes(16, "big")
        value = struct.pack(">BBH", 0, 0x02, xport) + xaddr6
    attr = struct.pack(">HH", XOR_MAPPED_ADDRESS, len(value)) + value
    return _HEADER.pack(BINDING_SUCCESS, len(attr), MAGIC_COOKIE, txid) + attr


def parse_binding_response(data: bytes, txid: bytes) -> tuple[str, int]:
    """(ip, port) from a Binding Success Response to transaction ``txid``."""
    mtype, length, got = _header(data)
    if mtype != BINDING_SUCCESS:
        raise StunError(f"STUN message type {mtype:#06x} is not a Binding Success Response")
    if got != txid:
        raise StunError("STUN response for another transaction")
    off = _HEADER.size
    end = off + length
    while off + 4 <= end:
        atype, alen = struct.unpack_from(">HH", data, off)
        value = data[off + 4 : off + 4 + alen]
        if len(value) != alen:
            raise StunError("truncated STUN attribute")
        if atype == XOR_MAPPED_ADDRESS:
            return _xor_address(value, txid)
        off += 4 + alen + (-alen % 4)
    raise StunError("STUN response without XOR-MAPPED-ADDRESS")


def _v6_mask(txid: bytes) -> int:
    """What an IPv6 address is XORed with: the magic cookie, then the transaction id."""
    return int.from_bytes(struct.pack(">I", MAGIC_COOKIE) + txid, "big")


def _xor_address(value: bytes, txid: bytes) -> tuple[str, int]:
    if len(value) < 4:
        raise StunError("short XOR-MAPPED-ADDRESS")
    family, xport = value[1], struct.unpack_from(">H", value, 2)[0]
    port = xport ^ (MAGIC_COOKIE >> 16)
    if family == 0x01 and len(value) == 8:
        ip = str(ipaddress.IPv4Address(struct.unpack_from(">I", value, 4)[0] ^ MAGIC_COOKIE))
    elif family == 0x02 and len(value) == 20:
        ip = str(ipaddress.IPv6Address(int.from_bytes(value[4:20], "big") ^ _v6_mask(txid)))
    else:
        raise StunError("bad XOR-MAPPED-ADDRESS family or length")
    return ip, port
