"""This host's interface addresses: hole punching's host candidates, the LAN discovery's
announcement and dial order, and ``p2pdist doctor``'s report.

IPv4 comes from ``getifaddrs`` (through ``ifaddr``, on Linux, macOS and Windows alike),
which lists every address of an interface, not only its first. IPv6 on Linux comes from
``/proc/net/if_inet6``, whose flags tell the addresses that cannot be used yet (or any
more) from those that can, and the temporary ones the kernel prefers as a source.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import sys

import ifaddr

__all__ = ["interface_addresses", "interface_addresses6", "local_ipv4"]

log = logging.getLogger(__name__)

_IFA_F_TEMPORARY = 0x01
_IFA_F_UNUSABLE = 0x08 | 0x20 | 0x40
"""IPv6 address flags (linux/if_addr.h): DAD failed, deprecated, tentative."""


def local_ipv4() -> list[tuple[str, ipaddress.IPv4Network]]:
    """This host's IPv4 addresses with their networks: each interface's first address,
    then each one's second, and so on (so an interface with many addresses, such as
    IPVS's dummy with a virtual address per service, cannot push every other
    interface's addresses past the callers' caps), loopback and link-local last."""
    per_interface: list[list[tuple[str, ipaddress.IPv4Network]]] = []
    for adapter in _adapters():
        found: list[tuple[str, ipaddress.IPv4Network]] = []
        for ip in adapter.ips:
            if isinstance(ip.ip, str):  # (IPv6 addresses are tuples)
                net = ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False)
                found.append((ip.ip, net))
        per_interface.append(found)
    rounds = itertools.zip_longest(*per_interface)
    interleaved = [address for each in rounds for address in each if address is not None]
    return sorted(interleaved, key=lambda a: a[1].is_loopback or a[1].is_link_local)


def interface_addresses() -> list[str]:
    """This host's IPv4 addresses, every one of each interface (loopback and link-local
    last)."""
    return list(dict.fromkeys(address for address, _ in local_ipv4()))


def interface_addresses6(table: str = "/proc/net/if_inet6") -> list[str]:
    """Global-scope IPv6 addresses of this host's interfaces that can be used now.
    Link-local, loopback, and (on Linux, from ``table``) tentative, deprecated and failed
    ones are left out; temporary (privacy) addresses come first, as the kernel prefers
    them as the source of outgoing datagrams (RFC 6724, rule 7). Elsewhere than Linux,
    the global ones ``getifaddrs`` lists, whose flags it does not give."""
    if not sys.platform.startswith("linux"):
        return _global_ipv6()
    try:
        with open(table) as f:
            lines = f.read().splitlines()
    except OSError:  # no IPv6 in this kernel
        return []
    temporary: list[str] = []
    stable: list[str] = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        try:
            addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
            scope, flags = int(fields[3], 16), int(fields[4], 16)
        except ValueError:
            continue
        if scope != 0 or flags & _IFA_F_UNUSABLE or addr.is_link_local or addr.is_loopback:
            continue
        (temporary if flags & _IFA_F_TEMPORARY else stable).append(str(addr))
    return list(dict.fromkeys(temporary + stable))


def _global_ipv6() -> list[str]:
    found: list[str] = []
    for adapter in _adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, tuple):
                addr = ipaddress.IPv6Address(ip.ip[0].split("%")[0])
                if not (addr.is_link_local or addr.is_loopback or addr.is_multicast):
                    found.append(str(addr))
    return list(dict.fromkeys(found))


def _adapters() -> list[ifaddr.Adapter]:
    """``ifaddr``'s interfaces; none when it fails (an interface without a netmask trips
    an assertion of its own off Linux): the callers then offer fewer addresses, they do
    not fail."""
    try:
        return list(ifaddr.get_adapters())
    except Exception as exc:  # whatever the platform's listing raised
        log.warning("cannot list this host's interfaces: %r", exc)
        return []
