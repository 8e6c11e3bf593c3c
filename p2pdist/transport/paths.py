"""Datagram paths under QUIC: a UDP socket (direct) and a relay (addressed by endpoint id).

A QUIC connection never touches a socket. Everything it sends leaves through its
:class:`Route`, which knows one way to the peer:

* :class:`UdpRoute`: a UDP socket of ours (:class:`UdpSocket`) and the peer's ip:port;
* :class:`RelayRoute`: a :class:`Relay` (the session to our home relay) and the peer's
  endpoint id. aioquic wants a network address for every datagram, so relay datagrams
  carry the synthetic address :data:`RELAY_ADDR`.

Received datagrams go the other way: the socket or the relay hands them to the
transport, which finds the connection (by QUIC connection id) and checks that they came
by that connection's route.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..identity import EndpointId

__all__ = [
    "RELAY_ADDR",
    "Relay",
    "RelayRoute",
    "Route",
    "UdpRoute",
    "UdpSocket",
    "all_loopback",
    "bind_host_for",
    "bind_udp",
    "is_loopback",
    "path_key",
    "plain_ip",
    "worth_probing",
]

log = logging.getLogger(__name__)

RELAY_ADDR = ("relay", 0)
"""The address aioquic sees for every datagram that travels through the relay."""
MAX_PATH_COUNTERS = 16
"""Direct paths a relayed connection keeps traffic counters for, each way; an older
one's counts are summed into :attr:`RelayRoute.earlier` when another comes."""

SOCKET_BUFFER = 4 << 20
"""Requested kernel send and receive buffer of a UDP socket (the kernel may cap it)."""
READ_BATCH = 64
"""Datagrams read per wake-up of a UDP socket before the event loop runs other work."""
SEND_QUEUE = 4096
"""Datagrams queued in user space while the kernel's send buffer is full."""

PathKind = Literal["direct", "relay"]
UdpAddress = tuple[str, int]


class Relay(Protocol):
    """What QUIC needs from a session to a relay (:class:`p2pdist.transport.relay_path.RelayPath`).

    Datagrams are best effort. ``on_datagram`` receives ``(source id, datagram)``; the
    relay authenticated the source, so it is the sender's endpoint id. ``on_peer_gone``
    receives the id of a destination the relay could not deliver to (not connected).
    ``on_datagram_size`` receives the new :attr:`max_datagram` when a new session (a
    reconnect) takes another size than the one before.
    """

    on_datagram: Callable[[EndpointId, bytes], None] | None
    on_peer_gone: Callable[[EndpointId], None] | None
    on_datagram_size: Callable[[int], None] | None
    max_datagram: int
    """Largest datagram the relay accepts, bytes."""

    @property
    def endpoint_id(self) -> EndpointId:
        """Our endpoint id (as authenticated to the relay)."""
        ...

    def send(self, dst: EndpointId, datagram: bytes) -> None:
        """Send one datagram to ``dst`` (dropped when the relay session is down)."""
        ...

    async def close(self) -> None:
        """End the relay session."""
        ...


class Route(Protocol):
    """One way to one peer: where a connection's datagrams go."""

    quic_addr: Any
    """The network address aioquic uses for the peer on this route."""

    @property
    def kind(self) -> PathKind:
        """``"direct"`` (UDP) or ``"relay"``: where datagrams go now."""
        ...

    @property
    def max_datagram(self) -> int:
        """Largest QUIC datagram to send on this route now, bytes."""
        ...

    @property
    def remote(self) -> UdpAddress | EndpointId:
        """The peer's ip:port (direct) or endpoint id (relay)."""
        ...

    @property
    def up(self) -> bool:
        """False once the route can carry nothing any more (socket closed)."""
        ...

    def send(self, datagram: bytes, addr: Any) -> None:
        """Send one datagram; ``addr`` is where aioquic wants it (direct routes use it)."""
        ...


def plain_ip(host: str) -> str:
    """``host`` (an IP address) with an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``)
    written as the IPv4 address it is: one name per peer, whichever socket family
    saw it. Anything else is returned unchanged."""
    if host.startswith("::ffff:") or host.startswith("::FFFF:"):
        try:
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
        except ValueError:
            return host
        if mapped is not None:
            return str(mapped)
    return host


def preferred_address(infos: list[Any], family: int) -> Any:
    """Of a name's ``getaddrinfo`` results, the first of ``family``, else the first. A
    QUIC transport binds and dials one address of a name, IPv4 unless its socket is of
    another family ("localhost" is ::1 first on many hosts): one that bound ::1 and one
    that dialed 127.0.0.1 would never meet, and UDP says nothing of a wrong address but
    the whole handshake timeout."""
    return next((info for info in infos if info[0] == family), infos[0])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def worth_probing(host: str, on_loopback: bool) -> bool:
    """Whether a peer's candidate address ``host`` is one to send PINGs to: not an
    unspecified, multicast or broadcast address (none is where a peer is), nor an IPv6
    link-local one (it needs the interface, which a candidate does not carry; IPv4's
    169.254/16 is routed on its link, and two hosts cabled together without DHCP have
    nothing else), and loopback only when ``on_loopback`` (our socket, or the relay
    that observes it, is on this host's loopback: a peer on this host). An
    authenticated peer could otherwise make us PING our own host's ports, or every
    host of our LAN."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast or ip == _BROADCAST:
        return False
    if ip.version == 6 and ip.is_link_local:
        return False
    return on_loopback or not ip.is_loopback


def bind_host_for(targets: list[UdpAddress]) -> str | None:
    """Where a socket that talks to ``targets`` binds: loopback only when there are
    targets and every one is on loopback (tests, one machine: 127.0.0.1, or ::1 when
    every one is IPv6), else None: every interface, dual-stack where the host has IPv6
    (:meth:`UdpSocket.open_any`; a socket bound to loopback can never reach anything
    elsewhere)."""
    if not targets or not all_loopback(targets):
        return None
    return "::1" if all(":" in h for h, _ in targets) else "127.0.0.1"


def bind_udp(
    family: int, addr: tuple[Any, ...], *, dual_stack: bool = True
) -> tuple[socket.socket, bool]:
    """A non-blocking UDP socket of ``family`` bound to ``addr``, and whether it carries
    IPv4 as well as IPv6 (an IPv6 wildcard address with IPV6_V6ONLY cleared: set, not
    left to the host's default, net.ipv6.bindv6only; where it cannot be cleared, as on
    OpenBSD, the socket stays IPv6 only). ``dual_stack=False``: an IPv6 socket carries
    IPv6 only (set, as asyncio's TCP listeners do)."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    dual = False
    try:
        sock.setblocking(False)
        if family == socket.AF_INET6 and not dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        elif family == socket.AF_INET6 and ipaddress.ip_address(addr[0]).is_unspecified:
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                dual = True
            except OSError:
                pass
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock, dual


def all_loopback(targets: list[UdpAddress]) -> bool:
    """Whether every one of ``targets`` is on loopback (True for none)."""
    return all(is_loopback(h) for h, _ in targets)


class UdpSocket:
    """One non-blocking UDP socket on the event loop.

    Received datagrams go to ``on_datagram(self, data, (ip, port))``, up to
    :data:`READ_BATCH` per wake-up: the connections they touch then send (ACKs, more
    data) once per batch instead of once per datagram. Nothing raised while handling a
    datagram escapes into the event loop. Sends go straight to the kernel; when its buffer
    is full they queue (up to :data:`SEND_QUEUE` datagrams, then drop: QUIC treats a drop
    as a loss). Sending on a closed socket drops silently.

    A socket bound to ``::`` is dual-stack (:attr:`dual_stack`): it reaches IPv6 and IPv4
    addresses alike, and IPv4 peers keep their plain ``a.b.c.d`` form both ways (the
    kernel's IPv4-mapped ``::ffff:a.b.c.d`` never shows above this class).
    """

    def __init__(
        self,
        sock: socket.socket,
        on_datagram: Callable[[UdpSocket, bytes, UdpAddress], None],
        *,
        dual_stack: bool = False,
    ) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._on_datagram = on_datagram
        self.dual_stack = dual_stack
        """Whether this IPv6 socket also carries IPv4 (bound to ``::``, V6ONLY off)."""
        self._loop = asyncio.get_running_loop()
        self._queue: deque[tuple[bytes, UdpAddress]] = deque()
        self._closed = False
        self.dropped = 0
        """Datagrams not sent: the socket was closed, the queue full, or the kernel refused."""
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        self._loop.add_reader(self._fd, self._readable)

    @classmethod
    async def open(
        cls, host: str, port: int, on_datagram: Callable[[UdpSocket, bytes, UdpAddress], None]
    ) -> UdpSocket:
        """Bind a socket on ``host:port`` (port 0: any free port); ``::`` binds one
        dual-stack socket for IPv6 and IPv4 (see the class)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = preferred_address(infos, socket.AF_INET)
        sock, dual = bind_udp(family, addr)
        return cls(sock, on_datagram, dual_stack=dual)

    @classmethod
    async def open_any(
        cls, port: int, on_datagram: Callable[[UdpSocket, bytes, UdpAddress], None]
    ) -> UdpSocket:
        """Bind every interface: one dual-stack socket (``::``) where the host has IPv6,
        else an IPv4 one (``0.0.0.0``)."""
        if socket.has_ipv6:
            try:
                sock = await cls.open("::", port, on_datagram)
            except OSError as exc:  # IPv6 off in this kernel or container
                log.debug("no dual-stack UDP socket (%s): binding IPv4 only", exc)
            else:
                if sock.dual_stack:
                    return sock
                sock.close()  # IPv6 only: IPv4 peers (the relay's STUN ports) unreachable
        return await cls.open("0.0.0.0", port, on_datagram)

    @property
    def local_address(self) -> UdpAddress:
        """The bound (host, port)."""
        name = self._sock.getsockname()
        return str(name[0]), int(name[1])

    @property
    def family(self) -> int:
        """``socket.AF_INET`` or ``socket.AF_INET6``."""
        return int(self._sock.family)

    def reaches(self, addr: UdpAddress) -> bool:
        """Whether this socket can send to ``addr``'s address family."""
        return self.dual_stack or (":" in addr[0]) == (self.family == socket.AF_INET6)

    @property
    def closed(self) -> bool:
        """True once the socket is closed."""
        return self._closed

    def send(self, data: bytes, addr: UdpAddress) -> None:
        """Send one datagram to ``addr`` (dropped if the socket is closed)."""
        if self._closed:
            self.dropped += 1
            return
        if self.dual_stack and ":" not in addr[0]:
            addr = ("::ffff:" + addr[0], addr[1])  # the kernel's name for an IPv4 peer
        if self._queue:
            self._enqueue(data, addr)
            return
        try:
            self._sock.sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            self._enqueue(data, addr)
            self._loop.add_writer(self._fd, self._writable)
        except OSError as exc:
            self.dropped += 1
            log.debug("UDP send to %s failed: %s", addr, exc)

    def close(self) -> None:
        """Close the socket (queued datagrams are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._queue:
            self._loop.remove_writer(self._fd)
            self.dropped += len(self._queue)
            self._queue.clear()
        self._sock.close()

    def _enqueue(self, data: bytes, addr: UdpAddress) -> None:
        if len(self._queue) >= SEND_QUEUE:
            self.dropped += 1
        else:
            self._queue.append((data, addr))

    def _writable(self) -> None:
        while self._queue:
            data, addr = self._queue[0]
            try:
                self._sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.dropped += 1
                log.debug("UDP send to %s failed: %s", addr, exc)
            self._queue.popleft()
        self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        for _ in range(READ_BATCH):
            try:
                data, addr = self._sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. an ICMP error reported on the socket
                log.debug("UDP receive error: %s", exc)
                return
            host = str(addr[0])
            if self.dual_stack and host.startswith("::ffff:"):
                host = plain_ip(host)  # an IPv4 peer on our dual-stack socket
            try:
                self._on_datagram(self, data, (host, int(addr[1])))
            except Exception:  # a datagram must never take the socket down
                log.exception("error while handling a datagram from %s", addr)
            if self._closed:
                return


class UdpRoute:
    """The direct path: a UDP socket of ours and the peer's ip:port."""

    kind: PathKind = "direct"

    def __init__(self, sock: UdpSocket, addr: UdpAddress, max_datagram: int) -> None:
        self.sock = sock
        self.quic_addr = addr
        self.max_datagram = max_datagram
        self.sent = [0, 0]
        """Datagrams and bytes sent."""
        self.received = [0, 0]
        """Datagrams and bytes received."""

    @property
    def remote(self) -> UdpAddress:
        """The peer's (ip, port)."""
        return self.quic_addr

    @property
    def up(self) -> bool:
        """False once our socket is closed."""
        return not self.sock.closed

    def send(self, datagram: bytes, addr: Any) -> None:
        """Send to ``addr`` (aioquic's current address of the peer)."""
        self.sent[0] += 1
        self.sent[1] += len(datagram)
        self.sock.send(datagram, addr)

    def count_received(self, nbytes: int) -> None:
        """A datagram of ``nbytes`` came on this path."""
        self.received[0] += 1
        self.received[1] += nbytes


class RelayRoute:
    """The relay path to one peer, addressed by its endpoint id, which hole punching can
    upgrade to a direct UDP path.

    aioquic always sees :data:`RELAY_ADDR` as the peer's address, whichever way a
    datagram actually travels: the QUIC connection does not care (and does not run its
    own path validation), while :class:`~p2pdist.transport.holepunch.HolePuncher` validates
    direct paths with signed probes. Once :meth:`use_direct` was called, datagrams go
    straight to the peer's ip:port; the relay stays the backup and still delivers.
    """

    quic_addr = RELAY_ADDR

    def __init__(self, relay: Relay, peer: EndpointId, max_datagram: int) -> None:
        self.relay = relay
        self.peer = peer
        self.relay_datagram = max_datagram
        self._first_datagram = max_datagram  # the QUIC connection was configured for it
        self.dropped = 0
        self.direct: tuple[UdpSocket, UdpAddress] | None = None
        self.direct_datagram = max_datagram
        self.changes = 0
        """How many times the path changed (direct <-> relay)."""
        self.sent: dict[UdpAddress | None, list[int]] = {None: [0, 0]}
        """Per path (None: the relay; else the peer's ip:port): [datagrams, bytes] sent;
        at most :data:`MAX_PATH_COUNTERS` direct ones (older ones go to :attr:`earlier`)."""
        self.received: dict[UdpAddress | None, list[int]] = {}
        """Per path: [datagrams, bytes] received (bounded likewise)."""
        self.earlier = [0, 0, 0, 0]
        """Datagrams and bytes sent, then received, on direct paths whose own counters
        were dropped (a peer behind a NAT that keeps rebinding meets many addresses)."""
        self._sending = self.sent[None]  # the counter of the path in use (hot path)
        self.also_relay = False
        """Send through the relay as well while direct (a closing connection's last
        datagrams: the direct path may have died unnoticed)."""

    @property
    def direct_addr(self) -> UdpAddress | None:
        """The peer's ip:port while datagrams go direct, else None (a direct path whose
        socket closed carries nothing: datagrams go through the relay)."""
        direct = self.direct
        return None if direct is None or direct[0].closed else direct[1]

    @property
    def kind(self) -> PathKind:
        """``"direct"`` once upgraded (and its socket open), else ``"relay"``."""
        return "relay" if self.direct_addr is None else "direct"

    @property
    def remote(self) -> UdpAddress | EndpointId:
        """The peer's ip:port while direct, else its endpoint id."""
        addr = self.direct_addr
        return self.peer if addr is None else addr

    @property
    def max_datagram(self) -> int:
        """The size for the path in use."""
        return self.relay_datagram if self.direct_addr is None else self.direct_datagram

    @property
    def up(self) -> bool:
        """Always True: the relay session reconnects by itself."""
        return True

    def use_direct(self, sock: UdpSocket, addr: UdpAddress, max_datagram: int) -> None:
        """Send to ``addr`` on ``sock`` from now on."""
        self.direct = (sock, addr)
        self.direct_datagram = min(max_datagram, self.relay_datagram)
        if addr not in self.sent:
            self.sent[addr] = [0, 0]
            self._forget_oldest(self.sent, 0)
        self._sending = self.sent[addr]
        self.changes += 1

    def resize_relay(self, max_datagram: int) -> bool:
        """The relay now takes datagrams of at most ``max_datagram`` bytes (a new session
        of it): build relayed ones to fit, never larger than the size the connection
        started with (the peer was told that size). Returns whether the size changed."""
        size = min(max_datagram, self._first_datagram)
        changed = size != self.relay_datagram
        self.relay_datagram = size
        return changed

    @property
    def direct_closed(self) -> bool:
        """Whether the direct path in use lost its socket: the connection then falls back
        to the relay (:meth:`use_relay`) before it sends again."""
        direct = self.direct
        return direct is not None and direct[0].closed

    def use_relay(self) -> None:
        """Send through the relay from now on."""
        if self.direct is not None:
            self.direct = None
            self._sending = self.sent[None]
            self.changes += 1

    def count_received(self, nbytes: int, addr: UdpAddress | None) -> None:
        """Account a datagram that arrived by ``addr`` (None: the relay)."""
        entry = self.received.get(addr)
        if entry is None:
            self.received[addr] = [1, nbytes]
            if addr is not None:
                self._forget_oldest(self.received, 2)
        else:
            entry[0] += 1
            entry[1] += nbytes

    def _forget_oldest(self, counters: dict[UdpAddress | None, list[int]], at: int) -> None:
        """Past :data:`MAX_PATH_COUNTERS` direct paths in ``counters``, add the oldest
        one's (never the relay's, nor the path in use) to :attr:`earlier` at ``at``."""
        if len(counters) - (None in counters) <= MAX_PATH_COUNTERS:
            return
        active = self.direct_addr
        oldest = next(a for a in counters if a is not None and a != active)
        datagrams, nbytes = counters.pop(oldest)
        self.earlier[at] += datagrams
        self.earlier[at + 1] += nbytes

    def send(self, datagram: bytes, addr: Any) -> None:
        """Send on the path in use; a datagram the relay refuses is dropped (QUIC resends).
        A direct path whose socket closed is left for the relay (counted as a change; the
        connection falls back before it sends, see :attr:`direct_closed`, so this serves a
        caller that sends without that check)."""
        direct = self.direct
        if direct is not None and direct[0].closed:
            log.debug("direct path to %s: socket closed, back to the relay", self.peer.short())
            self.use_relay()
            direct = None
        counter = self._sending
        counter[0] += 1
        counter[1] += len(datagram)
        if direct is not None:
            direct[0].send(datagram, direct[1])
            if not self.also_relay:
                return
        try:
            self.relay.send(self.peer, datagram)
        except Exception as exc:  # e.g. the relay lowered max_datagram after a reconnect
            self.dropped += 1
            log.debug("relay refused a datagram for %s: %s", self.peer.short(), exc)


def path_key(addr: UdpAddress) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6): how per-path counters name a direct path."""
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
