"""asyncio glue for hole punching: candidates, signed probes, timers, path switches.

One :class:`HolePuncher` serves a :class:`~p2pdist.transport.quic.QuicTransport` that has
a relay. For every peer connected through the relay it runs a
:class:`~.punch.PeerPaths` (the sans-I/O logic) and carries out its actions:

* our candidates (the address the relay's STUN ports observe, plus the UDP socket's
  interface addresses, IPv6 and IPv4 on a dual-stack socket) go to the peer through the
  relay, signed;
* PINGs and PONGs go over the UDP socket, signed (:mod:`p2pdist.wire.probe`) and bound
  to both sides' punching sessions; a probe that is not from the expected peer, or not
  for us, is dropped before it can touch any state, and one from another session is
  refused by :class:`~.punch.PeerPaths`;
* a path change moves the peer's QUIC datagrams (``on_change``): the QUIC connection
  keeps running, only the route below it changes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ..errors import ConnectionClosedError
from ..identity import EndpointId, SecretKey
from ..tasks import cancel_and_wait
from ..wire.probe import (
    MAX_CANDIDATES,
    ProbeError,
    ProbeKind,
    decode_probe,
    encode_candidates,
    encode_ping,
    encode_pong,
    peek_sender,
)
from .interfaces import interface_addresses, interface_addresses6
from .observe import StunProbe
from .paths import Relay, UdpAddress, UdpSocket, is_loopback, path_key, worth_probing
from .punch import Action, PathChange, PeerPaths, PunchConfig, SendCandidates, SendPing, SendPong

__all__ = [
    "HolePuncher",
    "Observation",
    "PunchingUnavailable",
]

log = logging.getLogger(__name__)

_EARLY_MAX = 64
"""Relayed probe messages kept for peers whose connection is not up yet (one each)."""
_EARLY_TTL = 5.0
_OBSERVATION_TTL = 60.0
"""Seconds an observation of our socket is reused before the relay's ports are asked again
(at once after a direct path died: our NAT may have given us another port)."""


class PunchingUnavailable(Exception):
    """Raised by a :class:`HolePuncher`'s ``open_socket`` when no socket of ours can punch
    (the message says why): hole punching is then off for good, and said so once."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the relay's observation ports saw of our UDP socket."""

    mapped: tuple[tuple[UdpAddress, UdpAddress], ...]
    """(relay observation address, our address as seen from it), one per answer."""
    at: float
    """When the answers came (event-loop time, like every other timestamp here)."""

    @property
    def addresses(self) -> list[UdpAddress]:
        """Our distinct server-reflexive addresses."""
        return list(dict.fromkeys(m for _, m in self.mapped))


_MAX_IPV6_CANDIDATES = 8
"""Most IPv6 interface addresses among our candidates."""


class _Peer:
    def __init__(self, peer: EndpointId, paths: PeerPaths) -> None:
        self.peer = peer
        self.paths = paths
        self.timer: asyncio.TimerHandle | None = None


class HolePuncher:
    """Hole punching for every peer connected through the relay (see module docstring).

    ``open_socket`` returns the UDP socket to punch from (opened once, on first use), or
    raises :class:`PunchingUnavailable`, which turns punching off (:attr:`off`);
    ``stun_targets`` the relay's observation ports; ``on_change(peer, sock, addr,
    reason)`` moves a peer's datagrams to ``addr`` on ``sock`` (None: the relay).
    """

    def __init__(
        self,
        key: SecretKey,
        relay: Relay,
        config: PunchConfig,
        *,
        open_socket: Callable[[], Awaitable[UdpSocket]],
        stun_targets: Callable[[], Awaitable[list[UdpAddress]]],
        on_change: Callable[[EndpointId, UdpSocket | None, UdpAddress | None, str], None],
        label_for: Callable[[EndpointId], str],
        datagram_size: Callable[[UdpAddress], int] = lambda addr: 0,
    ) -> None:
        self._key = key
        self._me = key.endpoint_id
        self._relay = relay
        self.config = config
        self._open_socket = open_socket
        self._stun_targets = stun_targets
        self._on_change = on_change
        self._label_for = label_for
        self._datagram_size = datagram_size
        """The largest datagram QUIC would send to an address: what a PING there is padded
        to, so that a path validates only if datagrams that large get through."""
        self._loop = asyncio.get_running_loop()
        self._peers: dict[EndpointId, _Peer] = {}
        self._sock: UdpSocket | None = None
        self._probe: StunProbe | None = None
        self._observation: Observation | None = None
        self._observing: asyncio.Task[Observation | None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._early: dict[EndpointId, tuple[bytes, float]] = {}
        self._closed = False
        self.bad_probes = 0
        """Probes dropped: bad signature, not for us, or from a peer we do not expect."""
        self.off: str | None = None
        """Why hole punching is off for good (no socket can punch), else None."""

    # ---- driven by the transport ------------------------------------------------------------

    @property
    def observation(self) -> Observation | None:
        """The latest answers of the relay's observation ports."""
        return self._observation

    def state(self, peer: EndpointId) -> PeerPaths | None:
        """The punching state towards ``peer`` (None: not connected through the relay)."""
        p = self._peers.get(peer)
        return None if p is None else p.paths

    def watch(self, peer: EndpointId) -> None:
        """A connection to ``peer`` through the relay is up: punch towards it."""
        if self._closed or self.off is not None or not self.config.enabled or peer in self._peers:
            return
        self._peers[peer] = _Peer(peer, PeerPaths(self.config))
        self._spawn(self._start(peer))

    def restart(self, peer: EndpointId) -> None:
        """Another connection to ``peer`` came up (it may have restarted, with a new
        socket): forget its paths, put its datagrams back on the relay, punch anew."""
        p = self._peers.get(peer)
        if p is not None and p.paths.current is not None:
            act = PathChange(p.paths.current, None, "a new connection: validating paths anew")
            self._change(p, act)
        self.unwatch(peer)
        self.watch(peer)

    def unwatch(self, peer: EndpointId) -> None:
        """No connection to ``peer`` through the relay is left: stop punching."""
        p = self._peers.pop(peer, None)
        if p is not None and p.timer is not None:
            p.timer.cancel()

    def accepts(self, peer: EndpointId, sock: UdpSocket, addr: UdpAddress) -> bool:
        """Whether a QUIC datagram from ``addr`` on ``sock`` may be ``peer``'s."""
        p = self._peers.get(peer)
        return p is not None and sock is self._sock and p.paths.accepts(addr)

    def on_relay_probe(self, src: EndpointId, data: bytes) -> None:
        """A probe message that came through the relay (from ``src``, authenticated)."""
        p = self._peers.get(src)
        if p is None or self._sock is None:
            # Its connection may still be finishing its handshake here, or our socket is
            # still opening: keep the latest message a few seconds for _start() (bounded;
            # the relay vouches for src).
            self._early.pop(src, None)
            self._early[src] = (data, self._loop.time())
            while len(self._early) > _EARLY_MAX:
                del self._early[next(iter(self._early))]
            return
        try:
            msg = decode_probe(data, self._me)
        except ProbeError as exc:
            self.bad_probes += 1
            log.debug("bad probe relayed from %s: %s", src.short(), exc)
            return
        if msg.sender != src or msg.kind is not ProbeKind.CANDIDATES:
            self.bad_probes += 1
            return
        log.debug("%s: candidates %s", self._label_for(src), msg.candidates)
        # Those of a family our socket cannot send to would only fail at every PING, and
        # those no peer can be at are not probed at all (see worth_probing).
        # A peer on this host: our socket is on loopback, or it is bound to every
        # interface and the relay, on loopback, saw it there.
        seen = self._observation.addresses if self._observation is not None else []
        on_loopback = is_loopback(self._sock.local_address[0]) or any(
            is_loopback(h) for h, _ in seen
        )
        reachable = tuple(
            a for a in msg.candidates if self._reaches(a) and worth_probing(a[0], on_loopback)
        )
        now = self._loop.time()
        acts = p.paths.on_candidates(reachable, msg.reply_wanted, now, session=msg.from_session)
        self._run(p, acts)

    def on_udp_probe(self, sock: UdpSocket, data: bytes, addr: UdpAddress) -> None:
        """A probe message (PING or PONG) that arrived on a UDP socket from ``addr``."""
        sender = peek_sender(data)
        p = self._peers.get(sender) if sender is not None else None
        if p is None or sock is not self._sock:
            self.bad_probes += 1
            return
        try:
            msg = decode_probe(data, self._me)
        except ProbeError as exc:
            self.bad_probes += 1
            log.debug("bad probe from %s: %s", addr, exc)
            return
        if not p.paths.fresh(msg.to_session, msg.from_session):
            self.bad_probes += 1
            log.debug("%s: probe from %s of another session", self._label_for(p.peer), addr)
            return
        now = self._loop.time()
        sessions = {"to_session": msg.to_session, "from_session": msg.from_session}
        if msg.kind is ProbeKind.PING:
            # The PONG is as large as the PING (a path must carry big datagrams both
            # ways), never larger: an answer is no amplifier.
            self._run(p, p.paths.on_ping(addr, msg.txid, now, **sessions), pong_size=len(data))
        elif msg.kind is ProbeKind.PONG:
            self._run(p, p.paths.on_pong(addr, msg.txid, now, **sessions))
        else:
            self.bad_probes += 1

    def on_stun(self, sock: UdpSocket, data: bytes, addr: UdpAddress) -> None:
        """A STUN message on our socket: maybe the answer of a relay observation port."""
        if sock is self._sock and self._probe is not None:
            self._probe.on_datagram(data)

    async def observe(self) -> Observation | None:
        """Ask the relay's observation ports where they see our socket (bounded by
        ``stun_timeout``); shared by concurrent callers, cached for a minute."""
        obs = self._observation
        if obs is not None and self._loop.time() - obs.at < _OBSERVATION_TTL:
            return obs
        if self._observing is None or self._observing.done():
            self._observing = self._loop.create_task(self._observe())
        return await asyncio.shield(self._observing)

    async def candidates(self) -> list[UdpAddress]:
        """Our candidate addresses: the observed ones first (across a NAT they are the
        only ones that work, so a host with many interfaces must not crowd them out of
        the :data:`MAX_CANDIDATES`), then the socket's local addresses: IPv6 ones
        (global, usually reachable through no more than a stateful firewall) before
        IPv4 ones (behind a NAT, they only work on the same LAN)."""
        sock = await self._socket()
        obs = await self.observe()
        host, port = sock.local_address
        if ipaddress.ip_address(host).is_unspecified:
            v6 = ":" in host  # "::": IPv6, and IPv4 too when dual-stack
            # Capped: a host with many IPv6 addresses must leave room for its IPv4 LAN
            # ones (peers on the same LAN reach those).
            hosts = interface_addresses6()[:_MAX_IPV6_CANDIDATES] if v6 else []
            if not v6 or sock.dual_stack:
                hosts += [h for h in interface_addresses() if not is_loopback(h)]
        else:
            hosts = [host]
        found: list[UdpAddress] = list(obs.addresses) if obs is not None else []
        found += [(h, port) for h in hosts]
        return list(dict.fromkeys(found))[:MAX_CANDIDATES]

    async def close(self) -> None:
        """Stop every timer and task (the socket belongs to the transport)."""
        self._closed = True
        for peer in list(self._peers):
            self.unwatch(peer)
        tasks: list[asyncio.Task[Any]] = [*self._tasks]
        if self._observing is not None:
            tasks.append(self._observing)
        await cancel_and_wait(tasks, timeout=1.0)

    # ---- internals ---------------------------------------------------------------------------

    def _reaches(self, addr: UdpAddress) -> bool:
        """Whether our socket can send to ``addr``'s address family."""
        return self._sock is None or self._sock.reaches(addr)

    async def _socket(self) -> UdpSocket:
        if self._sock is None or self._sock.closed:
            self._sock = await self._open_socket()
        return self._sock

    async def _observe(self) -> Observation | None:
        sock = await self._socket()
        targets = [t for t in await self._stun_targets() if self._reaches(t)]
        if not targets:
            return None
        self._probe = probe = StunProbe(targets)
        try:
            answers = await probe.run(sock.send, self.config.stun_timeout)
        finally:
            self._probe = None
        mapped = tuple((t, a) for t, a in zip(targets, answers, strict=True) if a is not None)
        obs = Observation(mapped, self._loop.time())
        self._observation = obs
        if not mapped:
            log.info("no answer from the relay observation ports %s (UDP blocked?)", targets)
        return obs

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except PunchingUnavailable as exc:
                self._switch_off(str(exc))
            except ConnectionClosedError:  # the transport closed under it: nothing to do
                pass
            except Exception:  # a punching hiccup must never surface in user code
                log.exception("hole punching task failed")

        task = self._loop.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Cancelled before its first step (a close right after), guarded() never awaits
        # coro: closed here instead ("never awaited" otherwise; a no-op once it ran).
        task.add_done_callback(lambda _: coro.close())

    def _switch_off(self, why: str) -> None:
        """No socket can punch: stop for every peer (they stay on the relay), say so once."""
        if self.off is not None:
            return
        self.off = why
        log.warning("hole punching is off, peers stay on the relay: %s", why)
        for peer in list(self._peers):
            self.unwatch(peer)

    async def _start(self, peer: EndpointId) -> None:
        await self._socket()
        p = self._peers.get(peer)
        if p is None:
            return
        self._run(p, p.paths.start(self._loop.time()))
        early = self._early.pop(peer, None)
        if early is not None and self._loop.time() - early[1] < _EARLY_TTL:
            self.on_relay_probe(peer, early[0])

    async def _send_candidates(self, p: _Peer, reply_wanted: bool) -> None:
        addrs = await self.candidates()
        if self._peers.get(p.peer) is not p:
            return
        data = encode_candidates(
            self._key, p.peer, addrs, reply_wanted=reply_wanted, session=p.paths.session
        )
        log.debug("%s: sending candidates %s", self._label_for(p.peer), addrs)
        self._relay.send(p.peer, data)

    def _run(self, p: _Peer, actions: list[Action], pong_size: int = 0) -> None:
        sock = self._sock
        mine = p.paths.session
        for act in actions:
            if isinstance(act, SendPing):
                if sock is not None:
                    data = encode_ping(
                        self._key,
                        p.peer,
                        act.txid,
                        to_session=act.session,
                        from_session=mine,
                        pad_to=self._datagram_size(act.addr),
                    )
                    sock.send(data, act.addr)
            elif isinstance(act, SendPong):
                if sock is not None:
                    data = encode_pong(
                        self._key,
                        p.peer,
                        act.txid,
                        act.addr,
                        to_session=act.session,
                        from_session=mine,
                        pad_to=min(pong_size, self._datagram_size(act.addr)),
                    )
                    sock.send(data, act.addr)
            elif isinstance(act, SendCandidates):
                self._spawn(self._send_candidates(p, act.reply_wanted))
            elif isinstance(act, PathChange):
                self._change(p, act)
        self._arm(p)

    def _change(self, p: _Peer, act: PathChange) -> None:
        name = self._label_for(p.peer)
        if act.new is not None:
            t0 = p.paths.round_started
            into = "" if t0 is None else f", {self._loop.time() - t0:.3f} s into the round"
            new = path_key(act.new)
            log.info("%s: path relay -> direct %s (%s%s)", name, new, act.reason, into)
        else:
            old = path_key(act.old) if act.old else "?"
            log.info("%s: path direct %s -> relay (%s)", name, old, act.reason)
            # The likeliest cause is a NAT that rebound our port: the next round must
            # offer where the relay sees us now, not the address cached before.
            self._observation = None
        self._on_change(p.peer, self._sock if act.new else None, act.new, act.reason)

    def _arm(self, p: _Peer) -> None:
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None
        at = p.paths.next_deadline()
        if at is not None and self._peers.get(p.peer) is p:
            p.timer = self._loop.call_at(at, self._fire, p)

    def _fire(self, p: _Peer) -> None:
        p.timer = None
        if self._peers.get(p.peer) is p:
            self._run(p, p.paths.poll(self._loop.time()))
