"""QuicTransport: QUIC connections over a UDP socket and/or a relay, routed by connection id.

Incoming datagrams, whatever path brought them, are routed the way aioquic's own asyncio
server does it: parse the QUIC header (``pull_quic_header``) and look the destination
connection id up among the ids our connections issued. A datagram must also come by the
connection's own route (the same UDP socket, or the relay with the same authenticated
source id); anything else, including garbage, is dropped and counted. A new Initial
packet (at least 1200 bytes, a supported version) on the listening socket or through the
relay starts a server-side connection; on the relay path its peer is the source id the
relay authenticated, and the certificate must carry that key.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from _buffer
from aioquic.quic.packet import QuicPacketType, QuicProtocolVersion, pull_quic_header

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    PeerTimeoutError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..wire.probe import DatagramKind, classify
from .base import IDENTITY_MISMATCH, Address, TransportConfig
from .framed import EndpointBase, FramedConnection
from .holepunch import HolePuncher, PunchingUnavailable
from .pathinfo import PathInfo, PathStats, single_path
from .paths import (
    RELAY_ADDR,
    Relay,
    RelayRoute,
    Route,
    UdpAddress,
    UdpRoute,
    UdpSocket,
    bind_host_for,
    is_loopback,
    path_key,
    plain_ip,
    preferred_address,
)
from .punch import PunchConfig
from .quic_conn import QuicConnection
from .quic_core import CID_LENGTH, PinnedQuicConnection, QuicConfig, quic_configuration
from .relay_path import RelayPath
from .tcp import parse_address

__all__ = ["QuicConnection", "QuicTransport"]

log = logging.getLogger(__name__)

_VERSIONS = frozenset({QuicProtocolVersion.VERSION_1, QuicProtocolVersion.VERSION_2})


class QuicTransport(EndpointBase[QuicConnection]):
    """Authenticated QUIC transport over UDP (direct) and/or a relay.

    ``relay`` (optional) is a running relay session (:class:`~.paths.Relay`, e.g.
    :class:`~p2pdist.transport.relay_path.RelayPath`). The transport takes it over: it sets
    its callbacks, accepts connections that come through it, and closes it in
    :meth:`close`. ``quic`` holds the QUIC-specific settings. Connections made through
    the relay try for a direct UDP path by hole punching (``punch``, see
    docs/nat-traversal.md), from the listening socket if there is one, else from a UDP
    socket of their own on every interface (one dual-stack socket on ``::``, so IPv6
    candidates too, where the host has IPv6, else ``0.0.0.0``; ``127.0.0.1`` when the
    relay is on loopback, or is an in-memory relay with no address); a listening socket
    bound to ``0.0.0.0`` punches over IPv4 only; one bound to loopback does not
    punch towards a relay elsewhere (punching stays off, with a warning). :meth:`paths`
    shows where each peer's datagrams go.
    """

    def __init__(
        self,
        key: SecretKey,
        config: TransportConfig | None = None,
        *,
        accept_from: Callable[[EndpointId], bool | str] | None = None,
        label_for: Callable[[EndpointId], str] | None = None,
        relay: Relay | None = None,
        quic: QuicConfig | None = None,
        punch: PunchConfig | None = None,
    ) -> None:
        super().__init__(key, config, accept_from, label_for)
        if not self.config.tls:
            raise UsageError("QUIC always encrypts: TransportConfig(tls=False) is for TCP only")
        self.quic_config = quic or QuicConfig()
        self.garbage = 0
        """Datagrams dropped because they belong to no connection of ours."""
        self._relay = relay
        self._udp: UdpSocket | None = None
        self._dial_sockets: dict[int, UdpSocket] = {}
        self._routes: dict[bytes, QuicConnection] = {}
        self._handshaking: dict[QuicConnection, asyncio.TimerHandle] = {}
        """Incoming connections still in their handshake, with their deadline timers."""
        self._live: set[QuicConnection] = set()
        self.punch_config = punch or PunchConfig()
        pc = self.punch_config
        fallback = pc.path_timeout + pc.keepalive
        if relay is not None and pc.enabled and self.config.idle_timeout <= fallback:
            log.warning(
                "idle_timeout (%g s) is not longer than the hole punching path_timeout plus "
                "keepalive (%g s): a direct path that dies may end the connection before "
                "it falls back to the relay (raise idle_timeout or lower path_timeout)",
                self.config.idle_timeout,
                fallback,
            )
        self._puncher: HolePuncher | None = None
        self._punch_sock: UdpSocket | None = None
        self._punch_lock = asyncio.Lock()
        if relay is not None:
            relay.on_datagram = self._on_relay_datagram
            relay.on_peer_gone = self._on_peer_gone
            relay.on_datagram_size = self._on_relay_datagram_size

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Bind the UDP socket that accepts connections; returns the bound (host, port)."""
        self._check_not_closed()
        if self._udp is not None:
            raise UsageError("already listening")
        try:
            udp = await self._open_udp(host, port)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc}") from None
        if self._udp is not None:  # another listen() ran while the socket was opening
            udp.close()
            raise UsageError("already listening")
        self._udp = udp
        return udp.local_address

    async def connect(
        self, peer: EndpointId, address: Address | None = None, *, label: str | None = None
    ) -> QuicConnection:
        """Connect to ``peer`` at ``address`` (UDP), or through the relay when it is None,
        and authenticate that the other end holds ``peer``'s key."""
        self._check_not_closed()
        name = label or self.label_for(peer)
        self._check_not_self(peer, name)
        # One bound for the name's lookup and the handshake, as TCP's connect has.
        deadline = asyncio.get_running_loop().time() + self.config.handshake_timeout
        route = await self._route_to(peer, address, name, deadline)
        self._check_not_closed()  # close() may have run while resolving or opening a socket
        conn = self._new_connection(route, server_side=False, expected=peer, label=name)
        where = path_key(route.remote) if isinstance(route, UdpRoute) else "relay"
        try:
            async with asyncio.timeout_at(deadline):
                conn.start_client()
                await conn.wait_established()
        except TimeoutError:
            conn.abort(PeerTimeoutError(name, "handshake timed out"))
            raise PeerTimeoutError(
                name, f"handshake via {where} took over {self.config.handshake_timeout} s"
            ) from None
        except BaseException as exc:
            conn.abort(exc if isinstance(exc, P2PError) else ConnectionClosedError("cancelled"))
            raise
        return conn

    async def _shutdown(self) -> None:
        """Close: every connection (bounded), the UDP sockets and the relay session."""
        for conn in list(self._handshaking):  # abort -> _forget ends its handshake timer
            conn.abort(ConnectionClosedError("transport is closed"))
        await self._close_all()
        for conn in set(self._routes.values()) | self._live:
            conn.stop()
        if self._puncher is not None:
            await self._puncher.close()
        for sock in [self._udp, self._punch_sock, *self._dial_sockets.values()]:
            if sock is not None:
                sock.close()
        if self._relay is not None:
            self._relay.on_datagram = None
            self._relay.on_peer_gone = None
            self._relay.on_datagram_size = None
            await self._relay.close()

    # ---- connections ---------------------------------------------------------------------

    async def _route_to(
        self, peer: EndpointId, address: Address | None, name: str, deadline: float
    ) -> Route:
        """The route to ``peer``: through the relay, or a UDP socket for ``address``,
        whose name is looked up by the loop time ``deadline``."""
        if address is None:
            if self._relay is None:
                raise UsageError(f"{name}: no address given and no relay to reach it through")
            return self._relay_route(self._relay, peer)
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except TimeoutError:
            raise PeerTimeoutError(
                name,
                f"looking up {path_key((host, port))} took over {self.config.handshake_timeout} s",
            ) from None
        except OSError as exc:
            raise ConnectionBrokenError(name, f"cannot resolve {host}: {exc}") from None
        self._check_not_closed()
        family, *_, sockaddr = self._preferred(infos)
        ip = plain_ip(str(sockaddr[0]))
        if ip != sockaddr[0]:  # ::ffff:a.b.c.d is an IPv4 peer: named as our sockets see it
            family = socket.AF_INET
        if ipaddress.ip_address(ip).is_unspecified:
            # The wildcard listen() may return: this host, as a TCP connect takes it (the
            # answer would come from a loopback address, which QUIC does not take).
            ip = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        try:
            sock = await self._socket_for(family, ip)
        except OSError as exc:  # e.g. no IPv6 on this host
            raise ConnectionBrokenError(name, f"cannot open a UDP socket for {ip}: {exc}") from None
        return self._udp_route(sock, (ip, int(sockaddr[1])))

    def _preferred(self, infos: list[Any]) -> Any:
        """Which of a name's addresses to dial (:func:`preferred_address`): of our
        listening socket's family, or IPv4 when we listen on both or none."""
        udp = self._udp
        if udp is None or udp.closed or udp.dual_stack:
            return preferred_address(infos, socket.AF_INET)
        return preferred_address(infos, udp.family)

    def _udp_route(self, sock: UdpSocket, addr: UdpAddress) -> UdpRoute:
        return UdpRoute(sock, addr, self._direct_datagram(addr))

    def _direct_datagram(self, addr: UdpAddress) -> int:
        """The datagram size for a direct UDP path to ``addr``."""
        qc = self.quic_config
        if is_loopback(addr[0]):
            return qc.loopback_datagram
        return qc.direct_datagram_ipv6 if ":" in addr[0] else qc.direct_datagram

    def congestion_control_for(self, route: Route) -> tuple[str, float | None]:
        """The congestion controller for the path ``route`` takes now, and the round trip
        from which it moves to BBR (see :meth:`QuicConfig.congestion_control_for`)."""
        remote = route.remote
        direct = route.kind == "direct" and isinstance(remote, tuple)
        loopback = isinstance(remote, tuple) and is_loopback(remote[0])
        return self.quic_config.congestion_control_for(direct=direct, loopback=loopback)

    def _relay_route(self, relay: Relay, peer: EndpointId) -> RelayRoute:
        return RelayRoute(relay, peer, self._relay_datagram(relay.max_datagram))

    def _relay_datagram(self, relay_takes: int) -> int:
        # QUIC needs 1200-byte datagrams; a relay that takes fewer drops them (and says so).
        return max(1200, min(self.quic_config.relay_datagram, relay_takes))

    def _on_relay_datagram_size(self, size: int) -> None:
        """A new relay session takes datagrams of at most ``size`` bytes: connections on
        the relay build theirs to fit from now on (what the relay refused is resent)."""
        fitting = self._relay_datagram(size)
        for conn in list(self._live):
            route = conn.route
            if isinstance(route, RelayRoute) and route.resize_relay(fitting):
                log.info(
                    "%s: relayed datagrams now at most %d bytes", conn.label, route.relay_datagram
                )
                if route.kind == "relay":
                    conn.path_changed()

    async def _socket_for(self, family: int, ip: str) -> UdpSocket:
        """The listening socket when it can reach ``ip``, else a dial-only socket (a
        socket bound to a loopback address cannot send elsewhere, and vice versa)."""
        udp = self._udp
        if udp is not None and not udp.closed and (udp.family == family or udp.dual_stack):
            host = udp.local_address[0]
            if ipaddress.ip_address(host).is_unspecified or is_loopback(host) == is_loopback(ip):
                return udp
        sock = self._dial_sockets.get(family)
        if sock is None or sock.closed:
            any_host = "::" if family == socket.AF_INET6 else "0.0.0.0"
            sock = await self._open_udp(any_host, 0)
            other = self._dial_sockets.get(family)
            if other is not None and not other.closed:  # a concurrent dial opened one
                sock.close()
                return other
            self._dial_sockets[family] = sock
        return sock

    def _new_connection(
        self,
        route: Route,
        *,
        server_side: bool,
        expected: EndpointId | None,
        label: str,
        odcid: bytes | None = None,
    ) -> QuicConnection:
        qc = self.quic_config
        congestion_control, bbr_from_rtt = self.congestion_control_for(route)
        configuration = quic_configuration(
            self.key,
            self.tls_identity.certificate,
            qc,
            is_client=not server_side,
            max_datagram=route.max_datagram,
            idle_timeout=2 * self.config.idle_timeout + 1.0,
            congestion_control=congestion_control,
        )
        quic = PinnedQuicConnection(
            configuration=configuration,
            stream_window=qc.stream_window,
            original_destination_connection_id=odcid,
        )
        quic.bbr_from_rtt = bbr_from_rtt
        conn = QuicConnection(
            self, quic, route, server_side=server_side, expected=expected, label=label
        )
        self._connections.add(conn)
        self._live.add(conn)
        self._route_cid(quic.host_cid, conn)
        if odcid is not None:
            self._route_cid(odcid, conn)
        return conn

    def _incoming(self, route: Route, odcid: bytes) -> QuicConnection | None:
        if len(self._handshaking) >= self.quic_config.max_pending_handshakes:
            self._note_handshake_slots_full(len(self._handshaking), "dropping new Initials")
            return None
        peer = route.remote if isinstance(route.remote, EndpointId) else None
        if peer is not None:
            label = self.label_for(peer)
        else:  # not yet authenticated: only where it came from (as TCP names it)
            label = f"incoming {path_key(cast(UdpAddress, route.remote))}"
        conn = self._new_connection(
            route, server_side=True, expected=peer, label=label, odcid=odcid
        )
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.config.handshake_timeout, self._handshake_deadline, conn)
        self._handshaking[conn] = timer
        return conn

    def _end_handshake(self, conn: QuicConnection) -> None:
        """``conn`` is no longer handshaking: drop it and its deadline timer (which would
        otherwise keep it alive until the deadline)."""
        timer = self._handshaking.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def _handshake_deadline(self, conn: QuicConnection) -> None:
        if self._handshaking.pop(conn, None) is not None:
            conn.handshake_expired()

    def _refusal(self, route: Route, presented: EndpointId) -> str | None:
        """Why a dialer whose certificate carries ``presented`` is refused, or None."""
        if isinstance(route, RelayRoute) and presented != route.peer:
            return (
                f"{IDENTITY_MISMATCH}: the relay authenticated {route.peer}, "
                f"the certificate presents {presented}"
            )
        return self.refusal_for(presented)

    def _on_established(self, conn: QuicConnection) -> None:
        self._end_handshake(conn)
        if self._closed:
            conn.abort(ConnectionClosedError("transport is closed"))
            return
        self._accepted.put(conn)

    def _forget(self, conn: FramedConnection) -> None:
        super()._forget(conn)
        self._end_handshake(cast(QuicConnection, conn))

    # ---- routing ---------------------------------------------------------------------------

    def _route_cid(self, cid: bytes, conn: QuicConnection) -> None:
        self._routes[cid] = conn

    def _unroute_cid(self, cid: bytes, conn: QuicConnection) -> None:
        if self._routes.get(cid) is conn:
            del self._routes[cid]

    def _unroute(self, conn: QuicConnection) -> None:
        for cid in [c for c, v in self._routes.items() if v is conn]:
            del self._routes[cid]
        self._live.discard(conn)
        route = conn.route
        if (
            isinstance(route, RelayRoute)
            and self._puncher is not None
            and not any(r.peer == route.peer for r in self._relay_routes())
        ):
            self._puncher.unwatch(route.peer)

    def _dispatch(
        self,
        data: bytes,
        addr: object,
        fits: Callable[[Route], bool],
        new_route: Callable[[], Route | None] | None,
    ) -> None:
        """Hand one datagram to its connection, start a new one, or drop it.

        ``new_route`` makes the route of a connection that this datagram may start (None:
        none may start here; it returns None: this source may not start one)."""
        if data and not data[0] & 0x80:
            # A short header (every packet after the handshake): the destination id is
            # ours, so its length is ours too. Only a connection may take it (aioquic
            # then checks the rest); parsing the header here cost more than this routing.
            conn = self._routes.get(data[1 : 1 + CID_LENGTH])
            if conn is None:
                self.garbage += 1
                return
            self._deliver(conn, data, addr, fits)
            return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LENGTH)
        except Exception:  # garbage: not even a QUIC header
            self.garbage += 1
            return
        conn = self._routes.get(header.destination_cid)
        if conn is None:
            if (
                new_route is None
                or self._closed
                or header.packet_type != QuicPacketType.INITIAL
                or header.version not in _VERSIONS
                or len(data) < 1200
            ):
                self.garbage += 1
                return
            route = new_route()
            if route is None:
                self.garbage += 1
                return
            conn = self._incoming(route, header.destination_cid)
            if conn is None:
                return
            conn.datagram_received(data, addr)
            if not conn.decrypted_any:  # it looked like an Initial, but is not one
                self.garbage += 1
                conn.discard()
            return
        self._deliver(conn, data, addr, fits)

    def _deliver(
        self, conn: QuicConnection, data: bytes, addr: object, fits: Callable[[Route], bool]
    ) -> None:
        """Hand a datagram to the connection it names, if it came by a path that fits."""
        route = conn.route
        if not fits(route):
            self.garbage += 1
            return
        if isinstance(route, RelayRoute):  # aioquic sees one address, whichever the path
            direct = addr is not RELAY_ADDR
            route.count_received(len(data), cast(UdpAddress, addr) if direct else None)
            if direct:
                conn.heard_directly()
            addr = RELAY_ADDR
        elif isinstance(route, UdpRoute):
            route.count_received(len(data))
        conn.datagram_received(data, addr)

    def _on_udp_datagram(self, sock: UdpSocket, data: bytes, addr: UdpAddress) -> None:
        kind = classify(data)
        if kind is not DatagramKind.QUIC:
            puncher = self._puncher
            if puncher is None or kind is DatagramKind.GARBAGE:
                self.garbage += 1
            elif kind is DatagramKind.PROBE:
                puncher.on_udp_probe(sock, data, addr)
            else:
                puncher.on_stun(sock, data, addr)
            return

        def fits(route: Route) -> bool:
            if isinstance(route, UdpRoute):
                return route.sock is sock
            puncher = self._puncher
            return (
                isinstance(route, RelayRoute)
                and puncher is not None
                and puncher.accepts(route.peer, sock, addr)
            )

        def new_route() -> Route | None:
            return self._udp_route(sock, addr)

        self._dispatch(data, addr, fits, new_route if sock is self._udp else None)

    def _on_relay_datagram(self, src: EndpointId, data: bytes) -> None:
        relay = self._relay
        if relay is None:
            return

        def fits(route: Route) -> bool:
            return isinstance(route, RelayRoute) and route.peer == src

        def new_route() -> Route | None:
            # The relay authenticated the source: a stranger may not start a handshake
            # at all (else anyone on the relay could fill our pending-handshake slots).
            return self._relay_route(relay, src) if self._may_start(src) else None

        # What raises here is counted and logged (sparingly) by the relay session, which
        # goes on: RelayPath._handle guards every handler it calls.
        if classify(data) is DatagramKind.PROBE:
            if self._puncher is not None:
                self._puncher.on_relay_probe(src, data)
            return
        self._dispatch(data, RELAY_ADDR, fits, new_route)

    def _may_start(self, src: EndpointId) -> bool:
        """Whether ``src`` (authenticated by the relay) may start a handshake: unless
        ``accept_from`` says False. One it refuses with a reason (a string: a member of a
        group that has formed already, say) starts too, so that the handshake's own check
        of the policy tells the dialer why, as on the UDP path, instead of dropping its
        packets until its handshake times out; so does one when ``accept_from`` raises."""
        if self._accept_from is None:
            return True
        try:
            return bool(self._accept_from(src))
        except Exception as exc:
            log.debug("accept policy failed for %s before its handshake: %r", src.short(), exc)
            return True

    def _on_peer_gone(self, peer: EndpointId) -> None:
        """The relay could not deliver to ``peer``: fail our dials to it through the relay
        (like a refused TCP connect). Established connections ride it out: the peer may be
        reconnecting to the relay, and the keepalive bounds the wait anyway."""
        for conn in list(self._live):
            route = conn.route
            if isinstance(route, RelayRoute) and route.peer == peer and conn.dialing:
                conn.abort(ConnectionBrokenError(conn.label, "is not connected to the relay"))

    # ---- hole punching -----------------------------------------------------------------

    def paths(self) -> dict[EndpointId, PathInfo]:
        """How each connected peer is reached now (see :class:`~.pathinfo.PathInfo`)."""
        out: dict[EndpointId, PathInfo] = {}
        # Of several connections to a peer: an open one, established, that carried the
        # most (not one still in its handshake, nor whichever the set gives first).
        ranked = sorted(
            self._live,
            key=lambda c: (
                c.closed,
                not c.established,
                -c.stats.bytes_sent - c.stats.bytes_received,
            ),
        )
        for conn in ranked:
            if conn.dialing or conn._peer is None or conn.peer_id in out:
                continue
            out[conn.peer_id] = self._path_info(conn)
        return out

    def _path_info(self, conn: QuicConnection) -> PathInfo:
        route = conn.route
        peer = conn.peer_id
        if isinstance(route, UdpRoute):  # dialed at an address: its datagrams, counted
            remote = path_key(route.remote)
            traffic = (route.sent[0], route.sent[1], route.received[0], route.received[1])
            return single_path(
                peer, remote, conn.stats, conn.rtt, "quic", conn.loss_info, traffic=traffic
            )
        assert isinstance(route, RelayRoute)
        state = self._puncher.state(peer) if self._puncher is not None else None
        active = route.direct_addr  # None: the relay (also when the direct socket closed)
        per_path = []
        for addr in sorted({None, active, *route.sent, *route.received}, key=str):
            sent = route.sent.get(addr, [0, 0])
            got = route.received.get(addr, [0, 0])
            probed = state.paths.get(addr) if state is not None and addr else None
            per_path.append(
                PathStats(
                    "relay" if addr is None else "direct",
                    "relay" if addr is None else path_key(addr),
                    addr == active,
                    datagrams_sent=sent[0],
                    bytes_sent=sent[1],
                    datagrams_received=got[0],
                    bytes_received=got[1],
                    rtt=probed.rtt if probed is not None else None,
                )
            )
        if any(route.earlier):
            per_path.append(PathStats("direct", "earlier paths", False, *route.earlier))
        url = self._relay.url if isinstance(self._relay, RelayPath) else None
        remote = path_key(active) if active else f"relay {url}" if url else "relay"
        return PathInfo(
            peer,
            route.kind,
            remote,
            conn.rtt,
            "quic",
            tuple(per_path),
            punching=state.phase.value if state is not None else "off",
            changes=route.changes,
            last_failure=state.last_failure if state is not None else self._punch_off(),
            loss=conn.loss_info,
        )

    def _relay_routes(self) -> list[RelayRoute]:
        return [c.route for c in self._live if isinstance(c.route, RelayRoute)]

    def _punch_towards(self, conn: QuicConnection) -> None:
        """``conn`` came up through the relay: punch towards its peer (if enabled)."""
        route = conn.route
        if not isinstance(route, RelayRoute) or not self.punch_config.enabled:
            return
        if self._puncher is None:
            assert self._relay is not None
            self._puncher = HolePuncher(
                self.key,
                self._relay,
                self.punch_config,
                open_socket=self._open_punch_socket,
                stun_targets=self._stun_targets,
                on_change=self._path_change,
                label_for=self.label_for,
                datagram_size=self._direct_datagram,
            )
        # A second connection to a peer we already punch towards: the peer may have
        # restarted behind a new port, so its old direct path proves nothing now.
        if any(r.peer == route.peer and r is not route for r in self._relay_routes()):
            self._puncher.restart(route.peer)
        else:
            self._puncher.watch(route.peer)

    def _punch_off(self) -> str | None:
        """Why hole punching is off for good, if it is."""
        return self._puncher.off if self._puncher is not None else None

    async def _open_punch_socket(self) -> UdpSocket:
        """The socket to punch from: the listening one if it can reach the relay's side,
        else one of our own. PunchingUnavailable when no socket of ours can punch."""
        self._check_not_closed()
        udp = self._udp
        if udp is not None and not udp.closed:
            host = udp.local_address[0]
            if is_loopback(host) and await self._local_relay_host() is None:
                raise PunchingUnavailable(
                    f"the listening socket is bound to {host}, which cannot reach a relay "
                    "or peers on other hosts (listen on :: or 0.0.0.0 to punch)"
                )
            return udp
        # Held across the awaits: peers watched at the same moment (a rank dialing several
        # at once) must share one socket. Two would leave the first one's probes teaching
        # peers an address whose later traffic never comes.
        async with self._punch_lock:
            if self._punch_sock is None or self._punch_sock.closed:
                # Every interface, IPv6 too where the host has it: peers whose IPv4
                # NATs cannot be punched often reach each other's IPv6 addresses.
                bind = await self._local_relay_host()  # None: every interface
                if bind is not None and isinstance(self._relay, RelayPath):
                    log.info(
                        "hole punching from %s: the relay is on this host's loopback, so "
                        "only peers on this host can go direct (peers elsewhere stay on "
                        "the relay: give the relay's public address to reach them)",
                        bind,
                    )
                self._punch_sock = await self._open_udp(bind, 0)
            return self._punch_sock

    async def _open_udp(self, host: str | None, port: int) -> UdpSocket:
        """A UDP socket of this transport (``host`` None: every interface, dual-stack
        where possible); ConnectionClosedError (and the socket closed) when close() ran
        while it was opening."""
        if host is None:
            sock = await UdpSocket.open_any(port, self._on_udp_datagram)
        else:
            sock = await UdpSocket.open(host, port, self._on_udp_datagram)
        if self._closed:
            sock.close()
            self._check_not_closed()
        return sock

    async def _local_relay_host(self) -> str | None:
        """The loopback address to punch from when the relay (so every peer met through
        it) is on this host, else None. Its observation ports decide (``::1`` where they
        are all on IPv6's loopback); when its address is unknown (it does not resolve to
        IPv4), its URL. A relay that is not a RelayPath has no address (an in-memory
        relay, in tests) and counts as local."""
        relay = self._relay
        if not isinstance(relay, RelayPath):
            return "127.0.0.1"
        targets = await relay.observation_targets()  # one lookup of the relay's name
        if targets:
            return bind_host_for(targets)
        host = relay.url.host
        if not (is_loopback(host) or host.lower() == "localhost"):
            return None
        return "::1" if ":" in host else "127.0.0.1"

    async def _stun_targets(self) -> list[UdpAddress]:
        """The relay's observation ports (none for a relay that is not a RelayPath)."""
        relay = self._relay
        return await relay.observation_targets() if isinstance(relay, RelayPath) else []

    def _path_change(
        self, peer: EndpointId, sock: UdpSocket | None, addr: UdpAddress | None, reason: str
    ) -> None:
        for conn in list(self._live):
            route = conn.route
            if isinstance(route, RelayRoute) and route.peer == peer:
                if sock is None or addr is None:
                    if route.direct is not None:  # a connection already on the relay
                        route.use_relay()  # keeps its congestion state and RTT
                        conn.path_changed(fell_back=True)
                else:
                    self._move(conn, sock, addr)

    def _move(self, conn: QuicConnection, sock: UdpSocket, addr: UdpAddress) -> None:
        route = conn.route
        assert isinstance(route, RelayRoute)
        route.use_direct(sock, addr, self._direct_datagram(addr))
        conn.path_changed()
