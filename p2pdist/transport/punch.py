"""Hole punching towards one peer, sans-I/O: which direct path to use, if any.

A :class:`PeerPaths` is fed what happens (candidates from the peer, PINGs and PONGs that
passed their signature check, the clock) and answers with :data:`Action` values for the
glue (:mod:`.holepunch`) to carry out: send a PING or PONG over UDP, send our candidates
through the relay, switch the connection to another path. Time is passed in.

States (:class:`Phase`)::

    IDLE --start--> PUNCHING --PONG--> DIRECT --path silent--> BACKOFF --retry--> PUNCHING
                        |                                         ^
                        +-------------- round timed out ----------+

While PUNCHING, every candidate address of the peer (the ones it sent, and the
peer-reflexive addresses its PINGs came from) gets a PING, then more with exponential
backoff, until a PONG comes back or the round ends. The first PONG validates that address
both ways: the connection's datagrams move to it (the relay stays as the backup path,
so nothing is lost while datagrams still in the relay arrive). On the direct path, a PING
every ``keepalive`` seconds holds the NAT mapping open and measures the RTT; when no PONG
came back for ``path_timeout`` seconds, datagrams return to the relay and a new round is
tried after a backoff. Only PONGs count as proof that our datagrams reach the peer: a
peer's PINGs only show that its datagrams reach us.

Every punching state has a random :attr:`PeerPaths.session`, sent to the peer with our
candidates through the (authenticated) relay. A PING or PONG counts only if it carries our
session and the peer's current one, so probes captured in another session cannot be
replayed to open or move a path; a PONG counts only for the transaction id and address of
a PING of ours that is still pending. What the peer may send from is tied to its session
too: when the peer's session changes, the addresses it was heard from, the PINGs still
waiting for a PONG and every direct path but the one in use are forgotten. What a replay
*within* the session can do is bounded: at most :data:`MAX_KNOWN` addresses heard from
and :data:`MAX_KNOWN` direct paths are remembered, peer-reflexive addresses are learned
(and answered) at most :data:`MAX_CANDIDATES` per ``retry_after`` seconds (a time window,
not a round, so a NAT that rebinds the peer's port while a direct path is up is answered
within one window), and a PING starts a round early at most once per ``retry_after``.
What the peer's own CANDIDATES can do is bounded too, since the peer may name any address
(a third party's): at most :data:`MAX_KNOWN` addresses new to us are taken (and probed) per
``retry_after`` window; further ones are left out until the peer sends its list again, so
a peer that sends list after list of fresh addresses cannot turn our PINGs into a flood
at others.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from ..wire.probe import MAX_CANDIDATES, TXID_LEN, check_session, new_session, session_time

__all__ = [
    "MAX_KNOWN",
    "MAX_PENDING",
    "Action",
    "Address",
    "PathChange",
    "PeerPaths",
    "Phase",
    "PunchConfig",
    "SendCandidates",
    "SendPing",
    "SendPong",
]

Address = tuple[str, int]

MAX_KNOWN = 2 * MAX_CANDIDATES
"""Most candidate addresses, most addresses heard from, and most direct paths kept for
one peer."""

MAX_PENDING = 4 * MAX_KNOWN
"""Most PINGs kept waiting for their PONG (the oldest are forgotten first)."""


@dataclass(frozen=True, slots=True)
class PunchConfig:
    """Hole-punching timers (seconds). The defaults suit internet paths; tests shorten
    them. docs/nat-traversal.md explains each."""

    enabled: bool = True
    """Try direct paths at all (False: relayed connections stay relayed)."""
    probe_interval: float = 0.1
    """Gap after the first PING to a candidate; it doubles after each further PING."""
    probe_interval_max: float = 1.0
    """Largest gap between PINGs to one candidate during a round."""
    punch_timeout: float = 6.0
    """Bound on one punching round: no PONG by then and the peer stays on the relay."""
    retry_after: float = 15.0
    """Wait before the next round after a failed one or a fallback; doubles each time."""
    retry_max: float = 300.0
    """Longest wait between rounds."""
    keepalive: float = 1.5
    """PING interval on the direct path in use (holds the NAT mapping, measures RTT)."""
    path_timeout: float = 5.0
    """No PONG on the direct path for this long: datagrams return to the relay."""
    stun_timeout: float = 1.0
    """Longest wait for our observed address before candidates are sent without it."""
    candidate_refresh: float = 1.0
    """A peer asking for our candidates gets them again only if we sent none this recently."""

    def __post_init__(self) -> None:
        for name in ("probe_interval", "punch_timeout", "keepalive", "path_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.path_timeout <= self.keepalive:
            raise ValueError("path_timeout must exceed keepalive")
        if self.probe_interval_max < self.probe_interval or self.retry_max < self.retry_after:
            raise ValueError("a maximum is below its initial value")


class Phase(enum.Enum):
    """Where punching towards one peer stands."""

    IDLE = "idle"
    PUNCHING = "punching"
    DIRECT = "direct"
    BACKOFF = "backoff"


@dataclass(frozen=True, slots=True)
class SendPing:
    """Send a PING with transaction id ``txid`` to ``addr`` over UDP, carrying the peer's
    ``session`` (and ours, :attr:`PeerPaths.session`)."""

    addr: Address
    txid: bytes
    session: bytes


@dataclass(frozen=True, slots=True)
class SendPong:
    """Answer the PING ``txid`` that came from ``addr``, carrying the peer's ``session``
    (and ours, :attr:`PeerPaths.session`)."""

    addr: Address
    txid: bytes
    session: bytes


@dataclass(frozen=True, slots=True)
class SendCandidates:
    """Send our candidate addresses and :attr:`PeerPaths.session` to the peer through
    the relay."""

    reply_wanted: bool


@dataclass(frozen=True, slots=True)
class PathChange:
    """Datagrams to the peer now go to ``new`` (None: through the relay)."""

    old: Address | None
    new: Address | None
    reason: str


Action = SendPing | SendPong | SendCandidates | PathChange


@dataclass(slots=True)
class _Allowance:
    """At most ``limit`` takes per window of ``window`` seconds; a window begins with the
    first take after the previous one ended."""

    limit: int
    window: float
    since: float | None = None
    taken: int = 0

    def take(self, now: float) -> bool:
        """Count one at ``now``; False (nothing counted) when this window is used up."""
        if self.since is None or not self.since <= now < self.since + self.window:
            self.since, self.taken = now, 0
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True


@dataclass(slots=True)
class _Candidate:
    next_probe: float
    interval: float
    announced: bool
    """In the peer's latest CANDIDATES (else peer-reflexive: a PING came from there)."""


@dataclass(slots=True)
class DirectPath:
    """A direct address that answered our PING."""

    addr: Address
    rtt: float
    """Smoothed PING round trip, seconds."""
    last_pong: float


class PeerPaths:
    """Hole punching and direct-path upkeep towards one peer (sans-I/O).

    ``new_txid`` makes transaction ids and ``session`` is our punching session (both
    random by default; tests pass their own)."""

    def __init__(
        self,
        config: PunchConfig,
        new_txid: Callable[[], bytes] | None = None,
        *,
        session: bytes | None = None,
    ) -> None:
        self.config = config
        self._new_txid = new_txid or (lambda: secrets.token_bytes(TXID_LEN))
        self.session = check_session(session if session is not None else new_session())
        """Our punching session: sent with our candidates, required in every probe."""
        self.peer_session: bytes | None = None
        """The peer's session, from its latest CANDIDATES (or first fresh PING)."""
        self.phase = Phase.IDLE
        self.current: Address | None = None
        """The direct address datagrams go to, or None (the relay)."""
        self.paths: dict[Address, DirectPath] = {}
        self.rounds = 0
        """Punching rounds started."""
        self.stale_probes = 0
        """PINGs and PONGs refused for carrying another session than ours and the peer's."""
        self.excess_pings = 0
        """PINGs of this session left unanswered: from a new address when the last
        ``retry_after`` seconds had already learned :data:`MAX_CANDIDATES` peer-reflexive
        ones (replays, most likely)."""
        self.session_changes = 0
        """Times the peer's session changed (what it was heard from was forgotten)."""
        self.stale_candidates = 0
        """CANDIDATES refused for carrying a session older than the peer's current one (a
        replay: the relay may deliver an old, validly signed one again)."""
        self.ignored_candidates = 0
        """Addresses in the peer's CANDIDATES left out (not probed, not remembered): the
        ``retry_after`` window already had :data:`MAX_KNOWN` new ones."""
        self.last_failure: str | None = None
        self.round_started: float | None = None
        self._candidates: dict[Address, _Candidate] = {}
        self._pending: dict[bytes, tuple[Address, float]] = {}
        self._heard: dict[Address, float] = {}
        self._reflexive = _Allowance(MAX_CANDIDATES, config.retry_after)
        """Peer-reflexive addresses learned (a PING from a new address)."""
        self._announced = _Allowance(MAX_KNOWN, config.retry_after)
        """Addresses new to us taken from the peer's CANDIDATES."""
        self._early_round_at: float | None = None
        self._round_end = 0.0
        self._retry_at = 0.0
        self._retry_delay = config.retry_after
        self._direct_since: float | None = None
        self._candidates_sent: float | None = None
        self._next_keepalive = 0.0
        self._asked_since: float | None = None
        """When the oldest keepalive PING on the current direct path that no PONG has
        answered since went out (None: every one is answered)."""

    # ---- inputs ------------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """The peer is connected through the relay: try for a direct path."""
        if self.phase in (Phase.PUNCHING, Phase.DIRECT):
            return []
        return self._begin_round(now, ask=True)

    def on_candidates(
        self, addrs: tuple[Address, ...], reply_wanted: bool, now: float, *, session: bytes
    ) -> list[Action]:
        """The peer sent its candidate addresses and its ``session`` (through the relay).

        The list replaces the one it sent before; peer-reflexive addresses stay while the
        peer's session does. A list from a session older than the peer's current one is a
        replay (sessions carry their creation time): refused and counted."""
        known = self.peer_session
        if known is not None and session != known and session_time(session) < session_time(known):
            self.stale_candidates += 1
            return []
        self._set_peer_session(session)
        out: list[Action] = []
        # Ours go out when asked (once per candidate_refresh), and whenever this state
        # never sent them: a reply meant for the state before a restart() can come before
        # the new state's start() asks, and the peer would not learn our new session.
        if self._candidates_sent is None or (
            reply_wanted and now - self._candidates_sent >= self.config.candidate_refresh
        ):
            self._candidates_sent = now
            out.append(SendCandidates(reply_wanted=False))
        wanted = dict.fromkeys(addrs[:MAX_CANDIDATES])
        for addr in [a for a, c in self._candidates.items() if c.announced and a not in wanted]:
            del self._candidates[addr]
        for addr in wanted:
            cand = self._candidates.get(addr)
            if cand is None:
                if self._announced.take(now):
                    self._candidates[addr] = _Candidate(now, self.config.probe_interval, True)
                else:  # the peer sends its list again when it starts its next round
                    self.ignored_candidates += 1
            else:
                cand.announced = True
                self._probe_soon(cand, now, pinged_us=False)
        self._trim_candidates()
        if self.phase in (Phase.IDLE, Phase.BACKOFF):
            out += self._begin_round(now, ask=False)
        return out + self.poll(now, timer=False)

    def on_ping(
        self, addr: Address, txid: bytes, now: float, *, to_session: bytes, from_session: bytes
    ) -> list[Action]:
        """An authenticated PING from the peer arrived from ``addr``, carrying the sessions
        it thinks are ours (``to_session``) and its own (``from_session``)."""
        if not self.fresh(to_session, from_session):
            return []
        self._set_peer_session(from_session)
        out: list[Action] = []
        if self.phase in (Phase.IDLE, Phase.BACKOFF) and (
            self._early_round_at is None or now - self._early_round_at >= self.config.retry_after
        ):
            # The peer is punching: join in now rather than at our next retry, but a PING
            # (which anyone on its path could replay) may cut the backoff short only once
            # per retry_after.
            self._early_round_at = now
            out += self._begin_round(now, ask=False)
        if addr not in self.paths and not self._add_reflexive(addr, now) and not self.accepts(addr):
            # A new address beyond this window's quota: answering it would make us a
            # reflector for replayed PINGs, so it gets nothing until the window ends.
            self.excess_pings += 1
            return out
        self._hear(addr, now)
        return [SendPong(addr, txid, from_session), *out, *self.poll(now, timer=False)]

    def on_pong(
        self, addr: Address, txid: bytes, now: float, *, to_session: bytes, from_session: bytes
    ) -> list[Action]:
        """An authenticated PONG from the peer arrived from ``addr`` (sessions as for
        :meth:`on_ping`)."""
        if not self.fresh(to_session, from_session):
            return []
        pending = self._pending.get(txid)
        if pending is None or pending[0] != addr:
            return []  # not ours, already answered, or from elsewhere than we asked
        del self._pending[txid]
        rtt = now - pending[1]
        path = self.paths.get(addr)
        if path is None:
            self.paths[addr] = DirectPath(addr, rtt, now)
            self._trim_paths()
        else:
            path.rtt = 0.875 * path.rtt + 0.125 * rtt
            path.last_pong = now
            if addr == self.current:
                self._asked_since = None
        self._hear(addr, now)
        if self.current is None:
            self.current = addr
            self.phase = Phase.DIRECT
            self._direct_since = now  # the retry delay restarts only once it has lasted
            self._next_keepalive = now + self.config.keepalive
            self._asked_since = None
            return [PathChange(None, addr, f"direct path validated (PING round trip {rtt:.4f} s)")]
        return []

    def accepts(self, addr: Address) -> bool:
        """Whether a QUIC datagram from ``addr`` may be delivered (the peer proved it sends
        from there, by a signed PING or PONG of this session)."""
        return addr in self._heard

    def poll(self, now: float, *, timer: bool = True) -> list[Action]:
        """What is due at ``now``: PINGs, the end of a round, keepalives, a fallback.

        A direct path falls back only when it has been silent for ``path_timeout`` and
        a keepalive has waited ``path_timeout - keepalive`` for its PONG (which on a
        loop that runs on time comes to the same): a silence of our own making, a
        process whose loop was held (a long computation between collectives) and sent
        no keepalive, is no evidence against the path. And only on ``timer`` polls, not
        on those a datagram makes (``timer=False``): after a stall the PONGs that came
        meanwhile are read before the timer runs, but maybe after a PING."""
        cfg = self.config
        out: list[Action] = []
        if self._pending and timer:  # (after a stall, PONGs read late still count)
            horizon = now - cfg.punch_timeout
            for txid in [t for t, (_, sent) in self._pending.items() if sent < horizon]:
                del self._pending[txid]
        if self.phase is Phase.PUNCHING:
            for addr, cand in self._candidates.items():
                if cand.next_probe <= now:
                    out.append(self._ping(addr, now))
                    cand.next_probe = now + cand.interval
                    cand.interval = min(cand.interval * 2, cfg.probe_interval_max)
            if now >= self._round_end:
                self._fail(now, f"no direct path after {cfg.punch_timeout:g} s of probing")
        elif self.phase is Phase.DIRECT:
            assert self.current is not None
            path = self.paths[self.current]
            silent_at = self._silent_at()
            if timer and silent_at is not None and now >= silent_at:
                old = self.current
                self.current = None
                self.paths.clear()
                self._fail(now, f"direct path {_fmt(old)} silent for {now - path.last_pong:.1f} s")
                out.append(PathChange(old, None, self.last_failure or ""))
            elif now >= self._next_keepalive:
                out.append(self._ping(self.current, now))
                self._next_keepalive = now + cfg.keepalive
                if self._asked_since is None:  # the oldest unanswered one counts
                    self._asked_since = now
        elif self.phase is Phase.BACKOFF and now >= self._retry_at:
            out += self._begin_round(now, ask=True)
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`poll` has something to do next (None: nothing is scheduled)."""
        if self.phase is Phase.PUNCHING:
            return min([self._round_end, *(c.next_probe for c in self._candidates.values())])
        if self.phase is Phase.DIRECT:
            silent_at = self._silent_at()
            if silent_at is None:  # silence counts only once a keepalive has asked
                return self._next_keepalive
            return min(self._next_keepalive, silent_at)
        if self.phase is Phase.BACKOFF:
            return self._retry_at
        return None

    # ---- internals ----------------------------------------------------------------------

    def _silent_at(self) -> float | None:
        """When the current direct path counts as dead (see :meth:`poll`); None while no
        keepalive waits for its PONG."""
        asked = self._asked_since
        if self.current is None or asked is None:
            return None
        cfg = self.config
        return max(
            self.paths[self.current].last_pong + cfg.path_timeout,
            asked + cfg.path_timeout - cfg.keepalive,
        )

    def fresh(self, to_session: bytes, from_session: bytes) -> bool:
        """Whether a probe carrying these sessions belongs to this punching session (else
        it is counted in :attr:`stale_probes` and must be ignored)."""
        if to_session == self.session and self.peer_session in (None, from_session):
            return True
        self.stale_probes += 1
        return False

    def _begin_round(self, now: float, *, ask: bool) -> list[Action]:
        self.phase = Phase.PUNCHING
        self.rounds += 1
        self.round_started = now
        self._round_end = now + self.config.punch_timeout
        for cand in self._candidates.values():
            cand.next_probe = now
            cand.interval = self.config.probe_interval
        if not ask:
            return []
        self._candidates_sent = now
        return [SendCandidates(reply_wanted=True)]

    def _set_peer_session(self, session: bytes) -> None:
        """The peer's probes now carry ``session``. When it differs from the one before,
        what we learned under the old one no longer says where the peer may send from:
        the addresses heard from, pending PINGs, peer-reflexive candidates and the direct
        paths are forgotten, except the direct path in use (its keepalives carry the new
        session from now on and drop it if the peer no longer answers there)."""
        old, self.peer_session = self.peer_session, session
        if old is None or old == session:
            return
        self.session_changes += 1
        keep = self.current
        self._heard = {a: t for a, t in self._heard.items() if a == keep}
        self.paths = {a: p for a, p in self.paths.items() if a == keep}
        self._candidates = {a: c for a, c in self._candidates.items() if c.announced or a == keep}
        self._pending.clear()
        self._reflexive = _Allowance(MAX_CANDIDATES, self.config.retry_after)

    def _add_reflexive(self, addr: Address, now: float) -> bool:
        """The peer's PING just came from ``addr``: probe it (a new address counts against
        the :data:`MAX_CANDIDATES` peer-reflexive ones allowed per ``retry_after``
        seconds). False: ``addr`` is not a candidate, and this window may learn no more."""
        cand = self._candidates.get(addr)
        if cand is not None:
            self._probe_soon(cand, now, pinged_us=True)
            return True
        if not self._reflexive.take(now):
            return False
        self._candidates[addr] = _Candidate(now, self.config.probe_interval, False)
        self._trim_candidates()
        return True

    def _probe_soon(self, cand: _Candidate, now: float, *, pinged_us: bool) -> None:
        if self.phase is not Phase.DIRECT and (
            pinged_us or cand.next_probe > now + self.config.probe_interval
        ):
            # The peer is punching right now (its PING just came through from there):
            # answer at once, while the hole is open, instead of at our next backoff step.
            cand.next_probe = min(cand.next_probe, now)

    def _trim_candidates(self) -> None:
        """Keep at most :data:`MAX_KNOWN` candidates: the oldest peer-reflexive go first."""
        excess = len(self._candidates) - MAX_KNOWN
        if excess > 0:
            old = [a for a, c in self._candidates.items() if not c.announced][:excess]
            for addr in old:
                del self._candidates[addr]

    def _hear(self, addr: Address, now: float) -> None:
        """Remember that the peer sends from ``addr``: at most :data:`MAX_KNOWN` addresses,
        the least recently heard that carries no validated path forgotten first, then the
        least recently heard other than the path in use (its direct path goes with it, so
        every direct path is also an address heard from)."""
        self._heard.pop(addr, None)
        self._heard[addr] = now
        if len(self._heard) > MAX_KNOWN:
            spare = [a for a in self._heard if a != self.current]
            old = next((a for a in spare if a not in self.paths), spare[0])
            del self._heard[old]
            self.paths.pop(old, None)

    def _trim_paths(self) -> None:
        """Keep at most :data:`MAX_KNOWN` direct paths: the longest silent, other than the
        one in use, go first."""
        while len(self.paths) > MAX_KNOWN:
            old = min(
                (p for a, p in self.paths.items() if a != self.current),
                key=lambda p: p.last_pong,
            )
            del self.paths[old.addr]
            self._heard.pop(old.addr, None)

    def _ping(self, addr: Address, now: float) -> SendPing:
        assert self.peer_session is not None  # candidates come with the peer's session
        txid = self._new_txid()
        self._pending[txid] = (addr, now)
        while len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        return SendPing(addr, txid, self.peer_session)

    def _fail(self, now: float, why: str) -> None:
        # A direct path that lasted retry_max starts the waits afresh; one that keeps
        # validating and dying soon after doubles them, as a failed round does.
        if self._direct_since is not None and now - self._direct_since >= self.config.retry_max:
            self._retry_delay = self.config.retry_after
        self._direct_since = None
        self.phase = Phase.BACKOFF
        self.last_failure = why
        self._retry_at = now + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self.config.retry_max)


def _fmt(addr: Address) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
