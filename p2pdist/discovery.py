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
from collections.abc import Awaitable

from zeroconf import InterfaceChoice, IPVersion, NonUniqueNameException
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from .errors import ConnectionClosedError, UsageError
from .identity import EndpointId
from .transport.interfaces import local_ipv4

__all__ = ["SERVICE_TYPE", "LanDiscovery", "dial_order"]

log = logging.getLogger(__name__)

SERVICE_TYPE = "_p2pdist._tcp.local."
"""The DNS-SD service type a rank announces itself under."""
ASK_EVERY = 1.0
"""Seconds one lookup of a rank waits for an answer (a dial asks again after that)."""

_Network = ipaddress.IPv4Network


def dial_order(theirs: list[str], ours: list[tuple[str, _Network]]) -> list[str]:
    """``theirs`` (a rank's announced addresses) in the order to dial them: those on a
    network this host is on first, then the others. Those that are this host's own too
    (a docker bridge's, the same on every host) are left out: dialed there, the dial
    would reach this host, and raced with the others it could win over a slow answer of
    the right one. They are all there is, and kept, for a rank on this very host."""
    mine = {address for address, _ in ours}
    if not set(theirs) <= mine:
        theirs = [a for a in theirs if a not in mine]

    def rank(address: str) -> bool:
        ip = ipaddress.IPv4Address(address)
        return not any(ip in net for _, net in ours)

    return sorted(dict.fromkeys(theirs), key=rank)


class LanDiscovery:
    """Announce this rank (``me``, listening on ``host:port``) on the local network and
    look other ranks up; ``host`` is the listening address: a specific IPv4 address keeps
    mDNS on that interface alone (``127.0.0.1``: this host only), ``0.0.0.0`` uses every
    interface. ``label`` names this rank in errors."""

    def __init__(self, me: EndpointId, host: str, port: int, label: str) -> None:
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
        self._label = label
        self._port = port
        self._ours = local_ipv4()
        if ip.is_unspecified:
            self._interfaces: InterfaceChoice | list[str] = InterfaceChoice.All
            announced = [a for a, net in self._ours if not net.is_loopback]
            self._announced = announced or [a for a, _ in self._ours]
        else:
            self._interfaces = [str(ip)]
            self._announced = [str(ip)]
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None
        """This rank's service, once its name is claimed (only then may close() say
        goodbye for it: another process's records would be dropped from every cache)."""
        self._announcing: Awaitable[object] | None = None
        """zeroconf's announcements after the name was claimed (a task it returns)."""
        self.found: dict[EndpointId, list[str]] = {}
        """Where each rank was last dialed: one address, or all of a round that failed
        (group/forming.py)."""

    async def start(self) -> None:
        """Announce this rank (returns once its name is claimed: about a second). A name
        another process announces (this rank's) is a :class:`UsageError` at once: mDNS
        tells of a conflict only while probing, and answers a probe repeated within a
        second no more, so a second try would claim the name beside its owner."""
        try:
            zc = AsyncZeroconf(interfaces=self._interfaces, ip_version=IPVersion.V4Only)
        except (OSError, RuntimeError) as exc:  # no interface it can join the group on
            where = ", ".join(self._announced) or "no IPv4 address"
            raise UsageError(
                f"{self._label}: local network discovery cannot start on {where} ({exc}): "
                "it needs an IPv4 interface that is up and takes multicast; give peers= "
                "or relay= instead"
            ) from None
        self._zc = zc
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self._me}.{SERVICE_TYPE}",
            port=self._port,
            addresses=[socket.inet_aton(a) for a in self._announced],
            server=self._host_name(self._me),
            properties={"v": "1"},
        )
        try:
            self._announcing = await zc.async_register_service(info)
        except NonUniqueNameException:
            raise UsageError(
                f"{self._label}: another process announces this rank on the local network "
                f"(its endpoint id, {SERVICE_TYPE}): a second process runs this rank with "
                "this seed, or the last run's has not closed yet"
            ) from None
        self._info = info
        log.debug("%s announced at %s port %d", self._label, self._announced, self._port)

    async def lookup(self, peer: EndpointId) -> list[str]:
        """``peer``'s ``host:port`` addresses, in the order to dial them
        (:func:`dial_order`), as the network (or what zeroconf heard of it already)
        answers within :data:`ASK_EVERY` seconds; empty when nothing answered."""
        zc = self._zc
        if zc is None:
            raise ConnectionClosedError(f"{self._label}: local network discovery is closed")
        info = AsyncServiceInfo(SERVICE_TYPE, f"{peer}.{SERVICE_TYPE}")
        if not await info.async_request(zc.zeroconf, ASK_EVERY * 1000) or not info.port:
            return []
        theirs = info.parsed_addresses(IPVersion.V4Only)
        return [f"{a}:{info.port}" for a in dial_order(theirs, self._ours)]

    def forget(self, peer: EndpointId) -> None:
        """Drop what zeroconf cached of ``peer`` (its service and host records), so that
        the next :meth:`lookup` asks the network: a lookup answers from the cache while
        that holds the records (for up to their 120 s), and a rank restarted on another
        port whose own announcements were lost would be dialed at the old one until then."""
        zc = self._zc
        if zc is None:
            return
        cache = zc.zeroconf.cache
        names = (f"{peer}.{SERVICE_TYPE}", self._host_name(peer))
        cache.async_remove_records([r for n in names for r in cache.async_entries_with_name(n)])

    @staticmethod
    def _host_name(peer: EndpointId) -> str:
        """The host name a rank's service record points at (its address records')."""
        return f"p2pdist-{peer}.local."

    async def close(self) -> None:
        """Withdraw the announcement (goodbye packets, which the caller bounds) and stop
        answering."""
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            if isinstance(self._announcing, asyncio.Future):
                self._announcing.cancel()
            if self._info is not None:
                sending = await zc.async_unregister_service(self._info)
                await sending  # (closing first would drop the goodbye unsent)
        finally:
            await zc.async_close()
