"""Client addresses as the relay sees them (pure functions, no I/O).

:func:`format_address` and :func:`unmap_ipv4` give the text form that logs and AUTH_OK
show, :func:`source_of` the source a connection counts against for the per-address caps,
and :func:`forwarded_ip` reads a proxied client's address from ``X-Forwarded-For``.
"""

from __future__ import annotations

import ipaddress

__all__ = ["format_address", "forwarded_ip", "source_of", "unmap_ipv4"]


def unmap_ipv4(ip: str) -> str:
    """``::ffff:192.0.2.1`` (an IPv4 client of a dual-stack socket) -> ``192.0.2.1``."""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def source_of(ip: str) -> str:
    """The source a waiting connection counts against: an IPv4 address, or the /64 of
    an IPv6 one (one host usually gets a whole /64). Unparsable strings stand alone."""
    ip = unmap_ipv4(ip)
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if addr.version == 6:
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def forwarded_ip(header: str, hops: int = 1) -> str | None:
    """The address in the ``hops``-th entry from the end of an ``X-Forwarded-For``
    value (the last by default: the one the proxy next to us added; each further proxy
    of ours in a row adds one), as ``ip``, ``ip:port``, ``[v6]`` or ``[v6]:port``,
    IPv4-mapped shown as IPv4; None without a valid one there (also when the header
    has fewer entries: a proxy of ours did not append)."""
    if hops < 1:  # entries[-0] would be the first: the client's own word
        raise ValueError(f"hops must be at least 1, got {hops}")
    entries = header.split(",")  # bounded: the whole request head is
    if len(entries) < hops:
        return None
    last = entries[-hops].strip()
    if last.startswith("["):
        inside, bracket, port = last[1:].partition("]")
        if not bracket or (port and not (port[0] == ":" and port[1:].isdigit())):
            return None
        last = inside
    elif last.count(":") == 1:
        last, _, port = last.partition(":")
        if not port.isdigit():
            return None
    if "%" in last:  # a zone id names an interface of the proxy's host, not a client
        return None
    try:
        addr = ipaddress.ip_address(last)
    except ValueError:
        return None
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return str(mapped or addr)


def format_address(ip: str, port: int) -> str:
    """``ip:port``, ``[v6]:port``; IPv4-mapped IPv6 addresses are shown as IPv4."""
    ip = unmap_ipv4(ip)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
