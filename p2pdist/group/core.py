"""GroupCore: a group's construction, connections and lifecycle, failure notices, and
point to point. How a collective runs (:meth:`~p2pdist.group.runner.Runner._run`) is
runner.py's job; the collectives themselves live in group.py (the reductions in
reducing.py)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import os
import weakref
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import msgpack
import numpy as np

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    GroupBrokenError,
    P2PError,
    PeerError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..settings import as_int, decimal_int, env_flag, env_token
from ..tasks import cancel_and_wait
from ..transport.base import Address, Connection, TransportConfig
from ..transport.framed import SendStalls
from ..transport.mailbox import SPACE_SHIFT
from ..transport.pathinfo import PathInfo
from ..transport.quic import QuicTransport
from ..transport.relay_path import RelayConfig, RelayPath, RelayStatus
from ..transport.tcp import TcpTransport, parse_address
from ..wire.arrays import ArrayHeader, ArrayHeaderError
from ..wire.frames import Frame
from ..wire.relay import RelayUrl
from . import p2p
from .buffers import as_array, expectation
from .config import GroupConfig
from .devices import on_host
from .link import as_told_to_others
from .membership import (
    _LEFT_BECAUSE,
    _START_FAILED,
    CONTROL_CHANNEL,
    LAST_SPACE,
    LEAVING_MAX,
    CallFailure,
    Membership,
    RunningCall,
)
from .runner import Runner, left_refusal
from .spaces import SpaceBook

if TYPE_CHECKING:
    from ..discovery import LanDiscovery

__all__ = ["GroupCore"]

_T = TypeVar("_T")
_GIVEN_UP_MAX = 64
"""Calls given up by other ranks that a group remembers (the first breaks it)."""
_DISCOVERY_CLOSE = 2.0
"""Seconds a closing group waits for its local-network announcement to be withdrawn."""

log = logging.getLogger(__name__)

_COLLECTIVE_SPACE = 0
_P2P_SPACE = 1
_FIRST_SUBGROUP_SPACE = 2


def _leaving_reason(exc: BaseException) -> str:
    """What a leaving notice says of ``exc``: its type and message, at most
    :data:`LEAVING_MAX` characters (never failing, whatever its ``__str__`` does)."""
    kind = type(exc).__name__
    try:
        text = str(exc).encode("utf-8", "backslashreplace").decode("utf-8")
    except Exception:  # a __str__ that raises: the type is still worth saying
        text = ""
    return (f"{kind}: {text}" if text else kind)[:LEAVING_MAX]


def _checked_rank(rank: object, world: int) -> int:
    """``rank`` as a plain int (numpy's integers taken, a bool not) in ``[0, world)``."""
    checked = as_int(rank)
    if checked is None:  # "0" from sys.argv, say: not a rank out of range
        raise UsageError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    if not 0 <= checked < world:
        raise UsageError(f"rank must be in [0, {world}), got {rank!r}")
    return checked


def _label(rank: int, eid: EndpointId) -> str:
    return f"rank {rank} ({eid.short()})"


def _check_peers(addresses: Sequence[Address]) -> None:
    """Each entry of a peers list is ``host:port``, and no two ranks share one (each
    rank listens on its own entry): said now, not after a whole ``connect_timeout``
    waiting for a rank that can never come, blamed on the wrong address."""
    seen: dict[tuple[str, int], int] = {}
    for r, address in enumerate(addresses):
        try:
            host, port = parse_address(address)
        except UsageError as exc:
            raise UsageError(f"peers entry of rank {r}: {exc}") from None
        where = (host.lower(), port)
        if where in seen:
            raise UsageError(
                f"rank {seen[where]} and rank {r} both have {address!r} in peers: each rank "
                "listens on its own entry, so every entry must be another host:port"
            )
        seen[where] = r


class GroupCore(Runner):
    """Membership, connections, failure handling and point-to-point of a group.

    Use :class:`~p2pdist.group.group.Group`, which adds the collectives.
    """

    def __init__(
        self,
        key: SecretKey,
        rank: int,
        peer_ids: Sequence[EndpointId],
        *,
        addresses: Sequence[Address] | None = None,
        listen: Address | None = None,
        config: GroupConfig | None = None,
        relay: str | None = None,
        relay_token: str | None = None,
        relay_proxy: str | None = None,
        rejoin: bool = False,
        _subgroup: bool = False,
    ) -> None:
        world = len(peer_ids)
        rank = _checked_rank(rank, world)
        if peer_ids[rank] != key.endpoint_id:
            raise UsageError(f"rank {rank}'s endpoint id does not match the secret key given")
        if len(set(peer_ids)) != world:
            raise UsageError("endpoint ids of a group must be distinct")
        if addresses is not None and len(addresses) != world:
            raise UsageError(f"need one address per rank: {world} ranks, {len(addresses)} given")
        if addresses is not None and not _subgroup:
            _check_peers(addresses)
        if relay is not None and not _subgroup and (addresses is not None or listen is not None):
            given = "peers=" if addresses is not None else "listen="
            raise UsageError(
                f"relay= reaches every rank by endpoint id through the relay; {given} is "
                "for TCP: give one of relay= or peers= (with listen=), not both"
            )
        self._relay_url = RelayUrl.parse(relay) if relay is not None else None
        self._relay_token = relay_token
        if relay_proxy and relay is None:
            raise UsageError("relay_proxy= is the way to a relay: pass relay= too")
        # "" keeps the connection direct even when P2PDIST_RELAY_PROXY is set
        self._relay_config = RelayConfig(proxy=relay_proxy)
        if relay is not None:  # a bad URL, given or from the environment, fails now
            self._relay_config.chosen_proxy()
        self._relay_path: RelayPath | None = None
        if self._relay_url is not None and not (config or GroupConfig()).transport.tls:
            raise UsageError("relay= runs QUIC, which always encrypts: do not pass tls=False")
        self._key = key
        self._rank = rank
        self._ids = list(peer_ids)
        self._rank_of = {eid: r for r, eid in enumerate(self._ids)}
        self._addresses = list(addresses) if addresses is not None else None
        if listen is not None:  # (P2PDIST_LISTEN too): now, not at start()
            try:
                parse_address(listen)
            except UsageError as exc:
                raise UsageError(f"listen=: {exc}") from None
        self._listen = listen
        self._discovery: LanDiscovery | None = None
        """Neither peers nor relay: the ranks find each other on the local network."""
        self.config = config or GroupConfig()
        self._transport: TcpTransport | QuicTransport | None = None
        self._conns: dict[int, Connection] = {}
        self._next_cid = 0
        self._pending: dict[int, int] = {}
        self._call_order = itertools.count()  # a sub-group shares its root's (_child)
        self._taking: int | None = None
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._p2p_sent: dict[int, int] = {}
        self._p2p_received: dict[int, int] = {}
        self._p2p_waiting: dict[asyncio.Task[Any], tuple[int, str]] = {}
        """(Sub-group) sends and recvs under way: task -> (peer, "send to"/"recv from")."""
        self._p2p_cut: dict[asyncio.Task[Any], P2PError] = {}
        """(Sub-group) those a close cut short, with the error each raises instead."""
        self._p2p_given_back: dict[int, list[int]] = {}
        """Per source: indices of recvs that ended before any of their message came (a
        timeout, a cancellation), smallest first: the next recv from it takes them."""
        self._broken: BaseException | None = None
        self._broken_during: int | None = None
        """The call (channel) whose failure broke the group, if one did."""
        self._left: dict[int, BaseException] = {}
        self._failure_log: list[BaseException] = []
        """What broke the group, in order: connections lost without a goodbye
        (ConnectionBrokenError) and abort notices (GroupBrokenError)."""
        self._started = False
        self._formed = False
        self._forming = None
        self._closing = False
        self._refusal_told: int | None = None
        """The call (channel) a refusal for a left rank was last told to the others."""
        self._closer: asyncio.Future[None] | None = None
        """The root group's closing, once close() began (see :meth:`close`)."""
        self._listeners: list[asyncio.Task[None]] = []
        # Channel spaces of this group; sub-groups from split() get their own pair.
        self._space = _COLLECTIVE_SPACE
        self._p2p_space = _P2P_SPACE
        self._parent: GroupCore | None = None
        self._spaces = SpaceBook(_FIRST_SUBGROUP_SPACE)  # used on the root group only
        self._reserved = {LAST_SPACE: "the group itself"}  # root only: space -> owner
        self._root_ranks = list(range(world))  # our ranks' ranks in the root group
        self._descendants: weakref.WeakSet[Membership] = weakref.WeakSet()  # root: sub-groups
        self._rejoin = rejoin
        self._rejoining = None  # root only, while start() rejoins
        self._kept_dials: dict[int, Connection] = {}  # root only: see Rejoining._keeps_own_dial
        if rejoin and self.config.on_peer_loss != "leave":
            raise UsageError('rejoin=True needs GroupConfig(on_peer_loss="leave")')
        # root only: running collectives, those a loss cancelled, those overdue
        self._inflight: dict[asyncio.Task[Any], RunningCall] = {}
        self._cancelled_by_loss: dict[asyncio.Task[Any], CallFailure] = {}
        self._cancelled_by_notice: set[asyncio.Task[Any]] = set()
        self._expired: set[asyncio.Task[Any]] = set()
        self._last_loss: dict[int, BaseException] = {}  # root: see Membership
        self._leaving: dict[int, str] = {}  # root: see Membership
        self._closed_by: dict[int, int] = {}  # see Membership
        self._unmade: set[int] = set()  # see Membership
        self._made_on: int | None = None  # see Membership
        self._rejoiners: dict[int, float] = {}  # root: see Rejoining
        self._closed_early: dict[int, list[tuple[int, int]]] = {}  # root: see Membership
        self._closed_calls: set[asyncio.Task[Any]] = set()  # root: cancelled by a sub-group's close
        self._watchdog: asyncio.TimerHandle | None = None  # root only: see _run
        self._watchdog_at = math.inf
        self._failed_calls: dict[int, CallFailure] = {}
        self._refused_from: dict[int, tuple[int, int]] = {}
        self._given_up: dict[int, GroupBrokenError] = {}
        """(Root) calls (channels) another rank gave up, with its abort notice."""

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def from_seed(
        cls,
        seed: str | bytes,
        *,
        rank: int,
        world: int,
        peers: Sequence[Address] | None = None,
        tls: bool | None = None,
        timeout: float | None = None,
        listen: Address | None = None,
        config: GroupConfig | None = None,
        relay: str | None = None,
        relay_token: str | None = None,
        relay_proxy: str | None = None,
        rejoin: bool = False,
    ) -> Self:
        """A group whose keys all derive from ``seed`` (a shared secret: whoever knows it
        can act as any rank).

        Either ``peers`` lists every rank's ``host:port`` in rank order (TCP; this rank
        listens on its own entry, or on ``listen``), or, with neither ``peers`` nor
        ``relay``, the ranks find each other on the local network by mDNS (TCP; this
        rank listens on ``listen``, default ``0.0.0.0:0``, and announces its endpoint id
        there: docs/architecture.md, "Finding the ranks"), or ``relay`` is a relay URL
        (``https://host:port/?pin=<id>``, as ``p2pdist-relay`` prints it): then the ranks
        reach each other by endpoint id alone, over QUIC through the relay, with no
        addresses at all (``relay_token`` for a relay that wants one; ``relay_proxy``,
        ``http://[user:password@]host:port``, when the relay is reachable only through an
        HTTP proxy: None takes P2PDIST_RELAY_PROXY when set). ``tls=False`` is
        authenticated plaintext TCP, for trusted networks only; None keeps ``config``'s
        setting (TLS by default). ``timeout`` sets ``config.timeout``, the default bound on
        every collective; forming the group (the relay session included) is bounded by
        ``config.connect_timeout`` instead. ``rejoin=True`` joins a running group again after this
        rank was lost (restarted with the same seed and rank; the others must run with
        ``GroupConfig(on_peer_loss="leave")``, and so must this rank): see
        docs/architecture.md §5."""
        world_int = as_int(world)
        if world_int is None or world_int < 1:
            raise UsageError(f"world must be an int >= 1, got {world!r}")
        rank_int = _checked_rank(rank, world_int)
        if isinstance(peers, str | bytes):  # one string would be taken letter by letter
            raise UsageError(
                f"peers must be a list of host:port strings, one per rank, got a string "
                f"{peers!r} (split it: peers.split(','))"
            )
        rank, world = rank_int, world_int
        cfg = config or GroupConfig()
        changes: dict[str, Any] = {}
        if timeout is not None:
            changes["timeout"] = timeout
        if tls is not None and tls != cfg.transport.tls:
            changes["transport"] = TransportConfig(
                **{**_fields(cfg.transport), "tls": tls}  # keep the other transport settings
            )
        if changes:
            cfg = GroupConfig(**{**_fields(cfg), **changes})
        keys = [SecretKey.from_seed(seed, r) for r in range(world)]
        return cls(
            keys[rank],
            rank,
            [k.endpoint_id for k in keys],
            addresses=list(peers) if peers is not None else None,
            listen=listen,
            config=cfg,
            relay=relay,
            relay_token=relay_token,
            relay_proxy=relay_proxy,
            rejoin=rejoin,
        )

    @classmethod
    def from_env(cls, *, config: GroupConfig | None = None) -> Self:
        """A seed group described by P2PDIST_SEED, P2PDIST_RANK, P2PDIST_WORLD and one of
        P2PDIST_PEERS (comma-separated host:port), P2PDIST_RELAY (a relay URL, with
        P2PDIST_RELAY_TOKEN if the relay wants one) or P2PDIST_LAN=1 (the ranks find
        each other on the local network by mDNS, as :meth:`from_seed` with neither
        ``peers`` nor ``relay``); P2PDIST_LISTEN (host:port) is ``listen`` for TCP;
        P2PDIST_TLS=0 (or false, no, off) selects plaintext."""

        def need(name: str) -> str:
            value = os.environ.get(name)
            if not value:
                raise UsageError(
                    f"environment variable {name} is not set: run this under "
                    "`p2pdist launch -n N -- ...` (ranks on this host), or set P2PDIST_SEED, "
                    "P2PDIST_RANK, P2PDIST_WORLD and P2PDIST_PEERS, P2PDIST_RELAY or "
                    "P2PDIST_LAN=1 on every host"
                )
            return value

        rank_text, world_text = need("P2PDIST_RANK"), need("P2PDIST_WORLD")
        try:  # only the conversions: UsageError is a ValueError too
            rank, world = decimal_int(rank_text), decimal_int(world_text)
        except ValueError:
            raise UsageError(
                "P2PDIST_RANK and P2PDIST_WORLD must be non-negative decimal integers"
            ) from None
        relay = os.environ.get("P2PDIST_RELAY") or None
        peers_text = os.environ.get("P2PDIST_PEERS", "")
        peers = [p.strip() for p in peers_text.strip().removesuffix(",").split(",")]
        if world == 1 or peers == [""]:
            peers = []
        if any(not p for p in peers):  # "a,,b": an address left out, not a separator
            raise UsageError(f"P2PDIST_PEERS has an empty entry: {peers_text!r}")
        lan = env_flag("P2PDIST_LAN", False)
        chosen = [
            name
            for name, given in (
                ("P2PDIST_PEERS", peers),
                ("P2PDIST_RELAY", relay),
                ("P2PDIST_LAN", lan),
            )
            if given
        ]
        if world > 1 and not chosen:
            raise UsageError(
                "set P2PDIST_PEERS (host:port list), P2PDIST_RELAY (a relay URL) or "
                "P2PDIST_LAN=1 (find the ranks on the local network)"
            )
        if len(chosen) > 1:  # one of them would be ignored: say so instead of guessing
            raise UsageError(
                f"both {chosen[0]} and {chosen[1]} are set: unset one (P2PDIST_PEERS: "
                "ranks reach each other at those addresses; P2PDIST_RELAY: through the "
                "relay; P2PDIST_LAN=1: they find each other on the local network)"
            )
        tls = env_flag("P2PDIST_TLS", True)
        return cls.from_seed(
            need("P2PDIST_SEED"),
            rank=rank,
            world=world,
            peers=peers or None,
            tls=tls,
            listen=os.environ.get("P2PDIST_LISTEN", "").strip() or None,
            config=config,
            relay=relay,
            relay_token=env_token() if relay else None,  # unused without a relay
        )

    # ---- properties -----------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self._ids)

    @property
    def endpoint_id(self) -> EndpointId:
        """This rank's endpoint id."""
        return self._key.endpoint_id

    @property
    def peer_ids(self) -> list[EndpointId]:
        """Every rank's endpoint id, in rank order."""
        return list(self._ids)

    @property
    def broken(self) -> BaseException | None:
        """The failure that made the group unusable, or None."""
        return self._broken

    def peer_label(self, rank: int) -> str:
        """How errors name this group's rank ``rank``: ``"rank 2 (abcdefghij)"``. A
        sub-group's ranks are named by their rank in the root group, as connections and
        every error name them (a sub-group's own numbering is local to it)."""
        r = _checked_rank(rank, self.size)
        return _label(self._root_ranks[r], self._ids[r])

    @property
    def relay_status(self) -> RelayStatus | None:
        """The relay session's state and counters, or None without a relay."""
        return self._relay_path.status if self._relay_path is not None else None

    def paths(self) -> dict[int, PathInfo]:
        """How each other rank is reached now, by rank: the path kind (``direct`` or
        ``relay``), the remote address, the smoothed RTT and the traffic per path. Over a
        relay, hole punching moves peers to direct paths when their NATs allow it
        (docs/nat-traversal.md); every change is also logged."""
        if self._transport is None:
            return {}
        by_id = self._transport.paths()
        return {r: by_id[c.peer_id] for r, c in sorted(self._conns.items()) if c.peer_id in by_id}

    def connection(self, rank: int) -> Connection:
        """The live connection to ``rank`` (for statistics and diagnostics)."""
        try:
            return self._conns[rank]
        except KeyError:
            raise UsageError(f"no connection to rank {rank}") from None

    def __repr__(self) -> str:
        state = "broken" if self._broken else ("started" if self._started else "new")
        return f"Group(rank={self._rank}, size={self.size}, id={self.endpoint_id.short()}, {state})"

    # ---- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._parent is not None and not self._closing:
            return self  # a sub-group: split() started it
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None and self._parent is None and self._formed and self._broken is None:
                # Our program failed, not the group (whose errors tell the others already):
                # say why before the goodbye, so that their errors about our leaving do too.
                if (refusal := left_refusal(exc)) is not None:
                    # The refusal for ranks that left first: not the reasons it quotes,
                    # which those ranks told everyone (each rank's error would nest them).
                    reason = f"GroupBrokenError: {refusal}"[:LEAVING_MAX]
                else:
                    reason = _leaving_reason(exc)
                self._send_control({"leaving": reason}, self._conns)
        finally:
            await self.close()

    async def start(self) -> Self:
        """Connect to every peer (bounded by ``config.connect_timeout``; with neither
        peers nor relay, announcing this rank on the local network takes about a second
        before that)."""
        if self._closing:
            if self._parent is not None:
                raise UsageError("this sub-group is closed; split() makes a new one")
            raise UsageError("group is closed; make a new Group to start again")
        if self._started:
            raise UsageError("group already started")
        self._started = True
        self._home_loop = asyncio.get_running_loop()
        if self.size == 1:
            self._formed = True
            return self
        try:
            # Bounded inside (a relay session waits at most connect_timeout and says why
            # it failed, e.g. "refused us: bad token"); a listen is immediate.
            transport = await self._open_transport()
        except BaseException as exc:
            await self._close_failed_start(exc)
            raise
        if self._rejoin:
            try:
                # Takes back other ranks from the start (they may rejoin at the same time).
                await self._rejoin_all(transport, self.config.connect_timeout)
            except BaseException as exc:
                await self._close_failed_start(exc)
                raise
            self._check_not_closed_while_starting()
        else:
            await self._form(transport)
            self._check_not_closed_while_starting()
            for r, conn in list(self._conns.items()):
                self._adopt(r, conn)
            if self.config.on_peer_loss == "leave":
                self._spawn(self._accept_rejoins(transport))
            else:
                self._spawn(self._refuse_late_dials(transport))
        self._formed = True
        log.info("%s: group of %d formed", self.peer_label(self._rank), self.size)
        return self

    def _check_not_closed_while_starting(self) -> None:
        """Raise if close() ran while start() formed (or rejoined) the group, as its last
        notes came in: never report success for a group already closing (its close goes
        on, and tells the ranks this one said ready to that its start stopped)."""
        if self._closing:
            raise self._closed_while_starting()

    async def _close_failed_start(self, exc: BaseException) -> None:
        """Close the group after ``exc`` ended its start; when a close() under way made it
        fail ("transport is closed", a connection "closed locally"), raise what start()
        says for that instead (the caller re-raises ``exc`` otherwise)."""
        closed_meanwhile = self._closing and isinstance(exc, P2PError)
        await self.close()
        if closed_meanwhile:
            raise self._closed_while_starting() from None

    def _where(self, r: int) -> str:
        if self._relay_url is not None:
            return f"through relay {self._relay_url}"
        if self._discovery is not None:
            found = self._discovery.found.get(self._ids[r])
            if found is not None:
                return f"at {', '.join(found)} (found on the local network)"
            return "(not found on the local network; ranks on other networks need peers= or relay=)"
        return f"at {self._addresses[r]}" if self._addresses else ""

    def _peer_name(self, eid: EndpointId) -> str:
        r = self._rank_of.get(eid)
        return _label(r, eid) if r is not None else f"unknown peer {eid.short()}"

    async def _open_transport(self) -> TcpTransport | QuicTransport:
        """TCP listening on our address, or QUIC over a session to the relay."""
        members = self._accepts
        if self._relay_url is not None:
            path = RelayPath(
                self._key, self._relay_url, token=self._relay_token, config=self._relay_config
            )
            self._relay_path = path
            quic = QuicTransport(
                self._key,
                self.config.transport,
                accept_from=members,
                label_for=self._peer_name,
                relay=path,
                punch=self.config.punch,
            )
            quic.send_stalls = SendStalls()  # members read on while one of our sends waits
            self._transport = quic
            await path.wait_connected(self.config.connect_timeout)
            return quic
        tcp = TcpTransport(
            self._key, self.config.transport, accept_from=members, label_for=self._peer_name
        )
        tcp.send_stalls = SendStalls()
        self._transport = tcp
        own = self._addresses[self._rank] if self._addresses is not None else "0.0.0.0:0"
        host, port = parse_address(self._listen or own)
        try:
            _, port = await tcp.listen(host, port)
        except OSError as exc:
            raise UsageError(
                f"{self.peer_label(self._rank)} cannot listen on {host}:{port}: {exc}"
            ) from None
        if self._addresses is None:  # announced, and each rank looked up as it is dialed
            from ..discovery import LanDiscovery  # (zeroconf: imported only when used)

            label = self.peer_label(self._rank)
            self._discovery = LanDiscovery(self.endpoint_id, host, port, label)
            await self._discovery.start()
        return tcp

    async def close(self) -> None:
        """Close every connection (bounded); the group cannot be used afterwards.

        Closing a sub-group leaves the connections to its parent: its own collectives
        still running here fail at once with GroupBrokenError, and its other members are
        told which calls this rank took part in: theirs that it did not (running or
        later) fail at once naming it, the others finish, and the parent goes on."""
        if self._closing:
            closer = self._closer
            # Not one whose loop has gone (asyncio.run ended): awaiting it would fail.
            if (
                closer is not None
                and not closer.done()
                and closer.get_loop() is asyncio.get_running_loop()
            ):
                await asyncio.shield(closer)
            return
        self._closing = True
        if self._parent is not None:
            root = self._root()
            closing = [self, *root._split_from(self)]  # its sub-groups end here too
            for g in closing:  # calls made but not started will never run: tell first
                for cid, holder in list(g._pending.items()):
                    g._skip(cid, holder, "its sub-group was closed before it started")
            if self._broken is None:
                self._broken = GroupBrokenError("the group was closed")
            for g in closing:
                g._send_control({"closed": g._space, "next": g._next_cid}, g._conns)
            root._cancel_closed(self)
            for g in closing:
                g._cut_p2p(None)
                for conn in g._conns.values():  # what the others still send it, dropped
                    conn.retire_space(g._space)
                    conn.retire_space(g._p2p_space)
            return
        healthy = self._broken is None
        if self._broken is None:
            self._broken = GroupBrokenError("the group was closed")
        self._tell_start_stopped()  # closed while start() formed the group
        # One task does the closing, shielded: a close() that is cancelled (an outer
        # timeout, a failing sibling, a second Ctrl-C) still finishes it in the
        # background, and another close() waits for the same task.
        self._closer = asyncio.ensure_future(self._close_root(healthy))
        await asyncio.shield(self._closer)

    async def _close_root(self, healthy: bool) -> None:
        if healthy:
            await self._let_sends_leave()
        await cancel_and_wait(self._listeners)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog, self._watchdog_at = None, math.inf
        if self._transport is not None:
            await self._transport.close()
        if self._discovery is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_DISCOVERY_CLOSE):
                    await self._discovery.close()

    async def _let_sends_leave(self) -> None:
        """A send returns once its message is handed to the connection, so the bytes of
        the last ones may still wait here for a peer whose loop is busy: give the peers
        the time a collective would give them (``timeout``) to take them, until no
        connection is backed up any more. The connections' own close then waits only for
        what is left below their low-water mark."""
        conns = [c for c in self._conns.values() if not c.closed]
        if conns:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.timeout):
                    await asyncio.gather(*(c.drain() for c in conns), return_exceptions=True)

    # ---- failure handling -------------------------------------------------------------

    async def _listen_control(self, rank: int, conn: Connection) -> None:
        """Act on ``rank``'s abort and failed-call notices until the connection ends."""
        with contextlib.suppress(P2PError, asyncio.CancelledError):
            while True:
                self._on_control(rank, await conn.recv(CONTROL_CHANNEL))

    def _read_notices(self, rank: int, conn: Connection) -> None:
        # The listener would read them on its next step, after the end is handled.
        while (frame := conn.recv_nowait(CONTROL_CHANNEL)) is not None:
            self._on_control(rank, frame)

    def _on_control(self, rank: int, frame: Frame) -> None:
        """Act on one notice from ``rank``."""
        call: tuple[int, int, str | None] | None = None
        onward = False
        closed: tuple[int, int] | None = None
        gone: int | None = None
        leaving: str | None = None
        try:
            body = msgpack.unpackb(frame.meta, raw=False)
            if "leaving" in body:  # it closes next, for this reason (its program failed)
                reason = str(body["leaving"])[:LEAVING_MAX]
                # ("start": its start failed after it said ready, see Forming)
                leaving = f"{_START_FAILED if body.get('start') else _LEFT_BECAUSE} {reason}"
            if "call" in body:  # one collective failed for want of a left rank
                why = body.get("why")  # or: that rank did not run it
                why = None if why is None else str(why)
                call = int(body["call"]), int(body["lost"]), why
                onward = body.get("onward") is True  # and every later call fails there
                if not 0 <= call[1] < self.size:
                    raise ValueError(f"no rank {call[1]}")
            if "closed" in body:  # it closed a sub-group we share
                closed = int(body["closed"]), int(body["next"])
            if "gone" in body:  # a rank left while we were rejoining
                gone = int(body["gone"])
                if not 0 <= gone < self.size:
                    raise ValueError(f"no rank {gone}")
            reason = str(body.get("abort", "no reason given"))
            during = body.get("during")  # the call it gave up (a channel), if one
            during = during if isinstance(during, int) else None
        except Exception:  # msgpack's own exceptions, a missing key, a bad type
            reason, during = "undecodable abort notice", None
        if call is not None:
            self._on_call_failed(*call, sender=rank, onward=onward)
        elif leaving is not None:
            self._leaving[rank] = leaving
        elif closed is not None:
            self._on_subgroup_closed(*closed, rank)
        elif gone is not None:
            self._on_gone_notice(gone, rank)
        else:
            notice = GroupBrokenError(f"{self.peer_label(rank)} aborted the group: {reason}")
            self._failure_log.append(notice)
            if during is not None:
                given_up = self._given_up
                given_up[during] = notice
                if len(given_up) > _GIVEN_UP_MAX:
                    del given_up[next(iter(given_up))]
            self._break(notice)

    def _break(
        self, error: BaseException, *, notify: bool = False, during: int | None = None
    ) -> None:
        """Mark the group unusable and wake every waiter with ``error``; ``notify``: tell
        the others too, naming the call (channel) ``during`` which failed, if one."""
        if self._broken is not None:
            return
        self._broken, self._broken_during = error, during
        if notify:
            told = as_told_to_others(str(error), self.peer_label(self._rank))
            body: dict[str, Any] = {"abort": told}
            if during is not None:
                body["during"] = during
            self._send_control(body, self._conns)
        for conn in self._conns.values():
            conn.interrupt(error)
        if self._parent is not None:
            # The connections are shared: a sub-group failure breaks its ancestors too.
            self._parent._break(
                GroupBrokenError("a sub-group failed", error), notify=notify, during=during
            )

    def _root(self) -> GroupCore:
        group = self
        while group._parent is not None:
            group = group._parent
        return group

    def _child(self, members: list[int], space: int) -> Self:
        """A sub-group of ``members`` (ranks of this group, in their new order) sharing
        this group's connections on channel spaces ``space`` and ``space + 1``."""
        child = object.__new__(type(self))
        GroupCore.__init__(
            child,
            self._key,
            members.index(self._rank),
            [self._ids[r] for r in members],
            addresses=[self._addresses[r] for r in members] if self._addresses else None,
            config=self.config,
            _subgroup=True,
        )
        child._conns = {i: self._conns[r] for i, r in enumerate(members) if r != self._rank}
        child._root_ranks = [self._root_ranks[r] for r in members]
        child._left = dict(self._left)
        child._home_loop = self._home_loop
        child._call_order = self._call_order
        self._root()._descendants.add(child)
        child._space, child._p2p_space = space, space + 1
        child._parent = self
        child._started = True
        root = self._root()
        for r, next_cid in root._closed_early.pop(space, []):  # closed before we had it
            if r in child._root_ranks:  # (a member's notice: a stranger's is no news)
                root._apply_closed(child, r, next_cid)
        return child

    def _check_usable(self, *, collective: bool = True) -> None:
        if self._parent is not None:
            self._parent._check_usable(collective=False)
        if not self._started:
            raise UsageError("the group is not started; use `async with Group...` or start()")
        if not self._formed and self._parent is None and self._broken is None:
            # Nothing taken yet (no call id, no send index): the call can simply come again.
            raise UsageError("the group is still starting; call once start() has returned")
        if self._broken is not None:
            if isinstance(self._broken, GroupBrokenError):
                raise self._broken
            raise GroupBrokenError("the group is broken", self._broken)
        # Under "leave", _run refuses the collective once it has taken its id.
        leave = self.config.on_peer_loss == "leave"
        if collective and self._left and not leave and (left := self.left):
            # The others may be in this call already, and later ones (they began them
            # before they saw the loss, and wait for our part): it fails here, so tell
            # them (not advancing our call id: every later call is refused too, and
            # names the same one).
            lost = self._root_ranks[min(left)]
            if self._taking is not None:  # a call reserved earlier (calls.py): that one
                self._tell_call_failed(self._call_channel(self._taking), lost)
            # Every call not reserved yet fails here too: theirs from that id on as well
            # (not from a reserved one: calls after it may have run here already).
            channel = self._call_channel(self._next_cid)
            if channel != self._refusal_told:  # once: a retry loop must not flood them
                self._refusal_told = channel
                self._tell_call_failed(channel, lost, onward=True)
            raise self._left_error(left)

    # ---- point to point -----------------------------------------------------------------

    def _check_rank(self, r: int, what: str) -> int:
        """``r`` as a plain int (numpy integers too, not bools), once it is a rank."""
        rank = as_int(r)
        if rank is None or not 0 <= rank < self.size:
            raise UsageError(f"{what} must be a rank in [0, {self.size}), got {r!r}")
        return rank

    def _conn_to(self, r: int) -> Connection:
        """The connection to rank ``r``. A rank that left with none (one a rejoining rank
        was told had left before it could reach it) raises what it left with, as a
        ConnectionBrokenError naming it, as a lost connection's own error does."""
        conn = self._conns.get(r)
        if conn is None:
            why = self.left.get(r)
            detail = why.detail if isinstance(why, PeerError) else str(why or "no connection")
            raise ConnectionBrokenError(self.peer_label(r), detail)
        return conn

    def _check_peer(self, r: int, what: str) -> int:
        rank = self._check_rank(r, what)
        if rank == self._rank:
            raise UsageError(f"{what} must be another rank, not this one ({rank})")
        return rank

    @on_host
    async def send(self, x: np.ndarray, dst: int, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst`` (matched in order by ``dst``'s :meth:`recv`).

        Returns once the message is handed to the connection (``x`` may then change);
        waits only while ``dst`` or the link is not keeping up. A send that raises (its
        ``timeout``) or is cancelled delivered no message: sending it again is safe.
        """
        dst = self._check_peer(dst, "dst")
        arr = as_array(x)
        try:  # refused here, before the message takes its place in the order
            header = ArrayHeader.of(arr)
        except ArrayHeaderError as exc:
            raise UsageError(f"send: {exc} (reshape it, and back on the receiving side)") from None
        seconds = self._seconds(timeout)
        self._check_usable(collective=False)
        self._check_loop("send")
        sub = self._parent is not None
        if sub and self._root_ranks[dst] in self._closed_by:
            raise self._closed_p2p_error(dst, "send to")
        index = self._p2p_sent.get(dst, 0)
        self._p2p_sent[dst] = index + 1
        channel = (self._p2p_space << SPACE_SHIFT) | index
        try:
            sending = p2p.send_array(self._conn_to(dst), channel, arr, header, seconds)
            await (self._p2p_wait(dst, "send to", sending) if sub else sending)
        except ConnectionClosedError:
            if self._root()._closing:
                raise self._closed_under("send to", dst) from None
            raise

    @on_host
    async def recv(
        self,
        src: int,
        *,
        like: np.ndarray | None = None,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Receive the next array rank ``src`` sent us.

        The expected dtype and shape come from ``out``, ``like`` or ``shape``/``dtype`` (any
        may be omitted to accept what arrives). A mismatch raises :class:`MismatchError`
        naming the sender; the message is discarded and the link stays usable. Without
        ``out``, a message of up to 64 MiB comes back as a writable view of the buffer it
        was received into (no copy; ``owndata`` is False), which stays the caller's.
        Dtypes are compared without their byte order (arrays travel little-endian; a
        big-endian ``out`` is filled with the right values), and a dtype that cannot
        travel (object, str, ...) is a :class:`UsageError` before any message is taken.
        """
        src = self._check_peer(src, "src")
        want = expectation(like, shape, dtype, out)
        seconds = self._seconds(timeout)
        self._check_usable(collective=False)
        deadline = self._check_loop("recv").time() + seconds
        try:
            receiving = self._recv_next(src, want, out, seconds, deadline)
            if self._parent is None:
                return await receiving
            return await self._p2p_wait(src, "recv from", receiving)
        except RemoteProtocolError as err:
            if self._gone_with(err) is None:
                self._break(err, notify=True)
            raise
        except ConnectionClosedError:
            if self._root()._closing:
                raise self._closed_under("recv from", src) from None
            raise

    async def _p2p_wait(self, peer: int, what: str, aw: Coroutine[Any, Any, _T]) -> _T:
        """Await ``aw``, a sub-group's send to or recv from ``peer`` (``what`` says
        which): a close of the sub-group, here or by ``peer``, cuts it short with an
        error saying so (:meth:`_cut_p2p`), where it would wait out its timeout."""
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()  # (a cancel already asked for is not ours to undo)
        self._p2p_waiting[task] = (peer, what)
        closer = self._root_ranks[peer]
        if closer in self._closed_by:
            # What the peer sent before it closed came before its notice: taken at once
            # if it is here; after that nothing more comes.
            asyncio.get_running_loop().call_soon(self._cut_p2p, closer)
        try:
            return await aw
        except asyncio.CancelledError:
            cut = self._p2p_cut.pop(task, None)
            if cut is not None and task.uncancel() <= cancelling:
                raise cut from None
            raise
        except PeerError as err:
            if isinstance(err, ConnectionBrokenError):
                raise
            # A message it was sending when it closed the sub-group: its send was cut and
            # said so ("stopped sending") after the close notice, which may be unread yet.
            self._root()._read_notices(closer, self._conns[peer])
            if closer in self._closed_by:
                raise self._closed_p2p_error(peer, what) from err
            raise
        finally:
            self._p2p_waiting.pop(task, None)
            self._p2p_cut.pop(task, None)

    def _cut_p2p(self, root_rank: int | None) -> None:
        """(Sub-group) cut short the sends and recvs under way with root rank
        ``root_rank``, which closed this sub-group (None: with anyone, this rank closed
        it). Called soon after the notice, not at once: a recv woken by a message that
        came before the notice takes it first."""
        for task, (peer, what) in list(self._p2p_waiting.items()):
            if task in self._p2p_cut or root_rank not in (None, self._root_ranks[peer]):
                continue
            gone = self._closed_under(what, peer) if root_rank is None else None
            self._p2p_cut[task] = gone or self._closed_p2p_error(peer, what)
            task.cancel()

    def _closed_p2p_error(self, peer: int, what: str) -> ConnectionBrokenError:
        """The error of a send to or recv from ``peer``, which closed this sub-group (or
        never had it: its split failed)."""
        why = self._closed_reason(self._root_ranks[peer]).removeprefix("it ")
        return ConnectionBrokenError(
            self.peer_label(peer), f"{why}: this {what} it cannot complete"
        )

    async def _recv_next(
        self,
        src: int,
        want: tuple[np.dtype[Any] | None, tuple[int, ...] | None],
        out: np.ndarray | None,
        seconds: float,
        deadline: float,
    ) -> np.ndarray:
        """Receive the next message from ``src`` in order, on the channel it takes, by
        the loop time ``deadline`` (``seconds``: the recv's timeout, for its error),
        past the messages withdrawn by their senders."""
        while True:
            given_back = self._p2p_given_back.get(src)
            if given_back:
                index = heapq.heappop(given_back)
            else:
                index = self._p2p_received.get(src, 0)
                self._p2p_received[src] = index + 1
            channel = (self._p2p_space << SPACE_SHIFT) | index
            conn = self._conn_to(src)

            def give_back(index: int = index, conn: Connection = conn) -> None:
                # Nothing of its message came: the next recv waits for it. Unless the
                # rank was taken back meanwhile: its new process numbers from 0.
                if self._conns.get(src) is conn:
                    heapq.heappush(self._p2p_given_back.setdefault(src, []), index)

            try:
                return await p2p.recv_array(
                    conn,
                    channel,
                    want,
                    out,
                    seconds,
                    self.config.max_message_bytes,
                    give_back,
                    deadline=deadline,
                )
            except p2p.Withdrawn:
                continue

    def _closed_under(self, what: str, peer: int) -> GroupBrokenError:
        """What a send or recv cut short by this rank's close of the group raises: the
        error a collective raises then."""
        return GroupBrokenError(f"{what} {self.peer_label(peer)} failed: the group was closed")


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
