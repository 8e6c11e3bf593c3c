"""Finding a group's ranks on the local network by mDNS / DNS-SD (zeroconf).

A group made with neither ``peers=`` nor ``relay=`` announces each rank as the service
``<endpoint id>._p2pdist._tcp.local.`` (its TCP port and IPv4 addresses), and looks the
other ranks up by name: a rank knows every other rank's endpoint id (they derive from
the seed), so it asks for those services and no others, and needs no browsing.

Nothing learned here is trusted: the connection then authenticates the endpoint id (TLS
pinned to it, or the plaintext handshake's signature), so whoever answers for a name can
misdirect a dial, never pass for the rank. mDNS reaches one link (multicast to
224.0.0.251, not routed): ranks on other networks need ``peers=`` or ``relay=``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

import ifaddr
from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from .errors import PeerTimeoutError, UsageError
from .identity import EndpointId

__all__ = ["SERVICE_TYPE", "LanDiscovery", "local_ipv4"]

log = logging.getLogger(__name__)

SERVICE_TYPE = "_p2pdist._tcp.local."
"""The DNS-SD service type a rank announces itself under."""
ASK_EVERY = 1.0
"""Seconds one lookup of a rank waits for an answer before it asks again."""

_Network = ipaddress.IPv4Network


def local_ipv4() -> list[tuple[str, _Network]]:
    """This host's IPv4 addresses with their networks, loopback and link-local last."""
    found: list[tuple[str, _Network]] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):  # (IPv6 addresses are tuples)
                net = ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False)
                found.append((ip.ip, net))
    return sorted(found, key=lambda a: a[1].is_loopback or a[1].is_link_local)


def pick_address(theirs: list[str], ours: list[tuple[str, _Network]]) -> str:
    """The one of ``theirs`` to dial: one on a network this host is on (a rank with
    several interfaces announces them all), else the first."""
    for address in theirs:
        ip = ipaddress.IPv4Address(address)
        if any(ip in net for _, net in ours):
            return address
    return theirs[0]


class LanDiscovery:
    """Announce this rank (``me``, listening on ``host:port``) on the local network and
    look other ranks up; ``host`` is the listening address: a specific IPv4 address keeps
    mDNS on that interface alone (``127.0.0.1``: this host only), ``0.0.0.0`` uses every
    interface."""

    def __init__(self, me: EndpointId, host: str, port: int) -> None:
        try:
            ip = ipaddress.ip_address(host or "0.0.0.0")
        except ValueError:
            raise UsageError(
                f"local network discovery needs an IPv4 listen address, got {host!r}"
            ) from None
        if not isinstance(ip, ipaddress.IPv4Address):
            raise UsageError(
                f"local network discovery announces IPv4 addresses: listen on one (or "
                f"0.0.0.0), not {host!r}"
            )
        self._me = me
        self._port = port
        self._ours = local_ipv4()
        if ip.is_unspecified:
            self._interfaces: InterfaceChoice | list[str] = InterfaceChoice.All
            announced = [a for a, net in self._ours if not ipaddress.IPv4Address(a).is_loopback]
            self._announced = announced or [a for a, _ in self._ours]
        else:
            self._interfaces = [str(ip)]
            self._announced = [str(ip)]
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    @property
    def announced(self) -> list[str]:
        """The addresses this rank announces (dialed at its port)."""
        return list(self._announced)

    async def start(self) -> None:
        """Announce this rank (returns once its name is claimed: about a second)."""
        self._zc = AsyncZeroconf(interfaces=self._interfaces, ip_version=IPVersion.V4Only)
        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self._me}.{SERVICE_TYPE}",
            port=self._port,
            addresses=[socket.inet_aton(a) for a in self._announced],
            server=f"p2pdist-{self._me}.local.",
            properties={"v": "1"},
        )
        await self._zc.async_register_service(self._info)
        log.debug("%s announced at %s port %d", self._me.short(), self._announced, self._port)

    async def find(self, peer: EndpointId, label: str, timeout: float) -> str:
        """``host:port`` of ``peer`` (named ``label`` in errors), asking until it answers;
        :class:`PeerTimeoutError` after ``timeout`` seconds."""
        assert self._zc is not None, "start() first"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = AsyncServiceInfo(SERVICE_TYPE, f"{peer}.{SERVICE_TYPE}")
            wait = min(ASK_EVERY, max(deadline - loop.time(), 0.0))
            if await info.async_request(self._zc.zeroconf, wait * 1000) and info.port:
                addresses = info.parsed_addresses(IPVersion.V4Only)
                if addresses:
                    return f"{pick_address(addresses, self._ours)}:{info.port}"
            if loop.time() >= deadline:
                raise PeerTimeoutError(
                    label,
                    f"not found on the local network within {timeout:g} s (mDNS, "
                    f"{SERVICE_TYPE}); ranks on other networks need peers= or relay=",
                )

    async def close(self) -> None:
        """Withdraw the announcement and stop answering."""
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            if self._info is not None:
                await zc.async_unregister_service(self._info)
        finally:
            await zc.async_close()
