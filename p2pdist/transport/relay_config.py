"""The relay client's settings and reports, with no I/O.

:class:`RelayConfig` is what a :class:`~.relay_path.RelayPath` is configured with
(validated; :data:`PROXY_ENV` names the proxy when the configuration does not),
:class:`RelayStatus` (with :class:`RelayState`) the snapshot it reports to callers and
``p2pdist doctor``, and :class:`ReconnectBackoff` its reconnect schedule (exponential,
with jitter). :func:`relay_keepalive` and :func:`parse_stun_ports` read two of the
relay's AUTH_OK offers. The session itself (dialing, authentication, keepalives,
datagrams) is :mod:`.relay_path`'s, which imports all of these back.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UsageError
from ..wire.httpproxy import ProxyUrl
from ..wire.relay import MAX_DATAGRAM, MAX_KEEPALIVE, MIN_READ

__all__ = [
    "CLIENT_KEEPALIVE",
    "PROXY_ENV",
    "ReconnectBackoff",
    "RelayConfig",
    "RelayState",
    "RelayStatus",
    "parse_stun_ports",
    "relay_keepalive",
    "relay_silence",
]

PROXY_ENV = "P2PDIST_RELAY_PROXY"
"""Environment variable naming the HTTP proxy relay connections go through (see
:attr:`RelayConfig.proxy`). The usual HTTPS_PROXY is not read: a proxy set for web
traffic must not silently carry a fleet's relay sessions too."""


CLIENT_KEEPALIVE = 3.0
"""Longest PING interval of the relay client, seconds, whatever the relay advertises (its
``--keepalive``, 15 s by default, is how often it needs to hear from a client). The
session counts as dead after three intervals without a byte from the relay and is
replaced by a new one: 9 s, well within the peers' 30 s ``idle_timeout``. With the relay's
45 s, a TCP session stalled by an outage (its retransmissions backed off to 16 s and more)
outlived the groups on it, though the network had come back long before."""


def relay_silence(interval: float, offered: object, rate: float) -> float:
    """Seconds without a byte from the relay after which the session counts as dead:
    three ``interval`` (our PING interval), or, under a relay ``rate`` so low that the
    relay may leave our PINGs unread longer (while our bucket refills to
    :data:`~p2pdist.wire.relay.MIN_READ`, at most its ``offered`` keepalive), that pause
    and two intervals more."""
    silence = 3 * interval
    if rate > 0:
        # A relay's keepalive is at most MAX_KEEPALIVE (it refuses to start otherwise):
        # an offer past it, or none, bounds the pause no better than that.
        longest = MAX_KEEPALIVE
        if isinstance(offered, int | float) and not isinstance(offered, bool) and offered > 0:
            longest = min(float(offered), MAX_KEEPALIVE)
        silence = max(silence, min(longest, MIN_READ / rate) + 2 * interval)
    return silence


def relay_keepalive(offered: object) -> float:
    """The keepalive interval to use for a relay's AUTH_OK ``keepalive``: the relay's,
    at most :data:`CLIENT_KEEPALIVE`, which is also taken when it is missing or outside
    (0, :data:`MAX_KEEPALIVE`] (inf, NaN or a day would switch off our pings and the
    silence check with them)."""
    value = float(offered) if isinstance(offered, int | float) else 0.0
    return min(value, CLIENT_KEEPALIVE) if value > 0 else CLIENT_KEEPALIVE  # NaN: False


class RelayState(enum.Enum):
    """Where the session to the relay stands."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKOFF = "backoff"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Relay client settings (seconds and bytes)."""

    connect_timeout: float = 10.0
    """Bound on TCP + TLS + upgrade + authentication of one attempt."""
    backoff_initial: float = 0.1
    """First reconnect delay; it doubles after every session that did not last."""
    backoff_max: float = 10.0
    """Largest reconnect delay (a RECONNECT's retry_after may ask for up to 60 s:
    MAX_RETRY_AFTER)."""
    keepalive: float | None = None
    """PING interval; None takes the relay's advertised value, at most
    :data:`CLIENT_KEEPALIVE` (3 s). Three intervals without a byte from the relay end the
    session, and a new one begins."""
    send_buffer: int = 4 << 20
    """Bytes queued towards the relay beyond which new datagrams are dropped (under a
    relay's rate limit, at most a quarter second of the rate, at least 256 KiB: the
    relay holds a client over its rate back, and a deeper queue only adds delay)."""
    records: bool = True
    """Offer AES-GCM records after the upgrade (docs/protocol.md 8.2; a relay that does
    not take them keeps TLS). False keeps TLS throughout (for comparisons)."""
    proxy: str | None = field(default=None, repr=False)  # it may hold a password
    """``http://[user:password@]host:port`` of an HTTP proxy to reach the relay through
    (a CONNECT tunnel; TLS to the relay runs inside it). None takes the environment
    variable P2PDIST_RELAY_PROXY when set; "" means no proxy whatever the environment."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.backoff_max < self.backoff_initial:
            raise ValueError("backoff_max must be at least backoff_initial")
        if self.keepalive is not None and not 0 < self.keepalive <= MAX_KEEPALIVE:
            raise ValueError(f"keepalive must be None or in (0, {MAX_KEEPALIVE:g}] s")
        if self.send_buffer < MAX_DATAGRAM + 1024:  # one largest datagram must fit
            raise ValueError(f"send_buffer must be at least {MAX_DATAGRAM + 1024} bytes")

    def chosen_proxy(self) -> ProxyUrl | None:
        """The proxy this configuration picks (``proxy``, else P2PDIST_RELAY_PROXY),
        parsed; None for a direct connection. UsageError for a bad URL."""
        if self.proxy is not None:
            return ProxyUrl.parse(self.proxy) if self.proxy else None
        chosen = os.environ.get(PROXY_ENV, "")
        try:
            return ProxyUrl.parse(chosen) if chosen else None
        except UsageError as exc:  # say where it came from: no flag of the user's
            raise UsageError(f"{PROXY_ENV} in the environment: {exc}") from None


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """A snapshot of the relay session, for callers and ``p2pdist doctor``. ``observed``,
    ``rtt``, ``limits`` and ``stun_ports`` are those of the latest session and stay when it
    ends (look at ``state``: they are current only while it is CONNECTED)."""

    url: str
    state: RelayState
    observed: str | None = None
    """Our ip:port as the relay sees it."""
    rtt: float | None = None
    """Last PING round trip, seconds."""
    connects: int = 0
    last_error: str | None = None
    refusal: str | None = None
    """Why the relay refused the latest attempt, or None: ``"bad_token"``,
    ``"not_allowed"`` (the allowlist), ``"bad_signature"``, ``"malformed"``,
    ``"pin_mismatch"`` (the relay's key is not the URL's pin: we refused it), or
    ``"proxy_refused"`` (the HTTP proxy refused the tunnel: 407 for credentials, 403)."""
    datagrams_sent: int = 0
    datagrams_received: int = 0
    dropped: int = 0
    """Datagrams dropped here (no session, or the send buffer full)."""
    bad_peer_ids: int = 0
    """RECV and PEER_GONE frames dropped because the endpoint id they named cannot be one
    (e.g. a small-order key): only a misbehaving relay sends them."""
    handler_errors: int = 0
    """Relayed datagrams (and PEER_GONE notices) whose handler (``on_datagram``,
    ``on_peer_gone``) raised: dropped (logged the 1st, 10th, 100th... time), and the
    session goes on."""
    replaced: int = 0
    """Sessions the relay ended because a newer connection authenticated our endpoint
    id: another process with this key (each time logged at the 1st, 10th, 100th...)."""
    limits: dict[str, float] = field(default_factory=dict)
    records: str | None = None
    """The record protection after the upgrade ("aes-256-gcm"), or None when TLS
    carries the frames (the relay did not take the offer, or none was made)."""
    stun_ports: tuple[int, ...] = ()
    """The relay's UDP observation ports (STUN Binding), from AUTH_OK; two ports let a
    client tell endpoint-independent from endpoint-dependent NAT mapping. Empty when the
    relay advertises none (or sent something malformed)."""
    proxy: str | None = None
    """The HTTP proxy the session is tunnelled through (``http://host:port``, without
    credentials), or None for a direct connection."""
    framing: str | None = None
    """How relay frames travel after the upgrade: ``"raw"`` (the relay's own TLS port),
    or ``"websocket"`` (WebSocket binary frames: a relay behind a TLS-terminating reverse
    proxy, or one that did not take records)."""
    proof: str | None = None
    """What our AUTH proof was bound to: ``"certificate"`` (the relay's TLS certificate
    as we saw it) or ``"name"`` (the relay URL's host and port: a relay behind a proxy or
    load balancer with certificates of its own, docs/relay.md)."""

    @property
    def refused(self) -> bool:
        """Whether the relay refused the latest attempt, or was not the pinned relay, or
        the proxy refused the tunnel (:attr:`refusal` and ``last_error`` say which: a bad
        token, an allowlist, another key, the proxy's credentials): retrying goes on, but
        only a change to the relay or to this client's settings will let it in."""
        return self.refusal is not None


def parse_stun_ports(value: object) -> tuple[int, ...]:
    """AUTH_OK's ``stun_ports`` as a tuple of distinct ports 1..65535, in order; ``()``
    when absent or malformed (a list of anything else, too long, not a list)."""
    if not isinstance(value, list | tuple) or len(value) > 8:
        return ()
    ports: list[int] = []
    for p in value:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= 65535:
            return ()
        if p not in ports:
            ports.append(p)
    return tuple(ports)


class ReconnectBackoff:
    """How long to wait before dialing the relay again (sans-I/O; ``random`` returns a
    float in [0, 1) and is injectable for tests).

    After a failure the wait is uniform in [0, delay) ("full jitter"). After a RECONNECT
    notice it is uniform in [base, 1.5 x base) with base = max(retry_after, delay), so
    the clients of a relay that shuts down do not all return at the same instant, and a
    relay that keeps answering RECONNECT (even with retry_after 0) is dialed ever more
    slowly. ``delay`` starts at ``initial`` and doubles after every session, up to
    ``maximum``; only a session that lasted ``10 x maximum`` after authenticating resets it.
    """

    LONG_SESSION = 10
    """A session this many ``maximum`` long resets the delay."""

    def __init__(self, initial: float, maximum: float, random: Callable[[], float]) -> None:
        self.initial, self.maximum, self._random = initial, maximum, random
        self.delay = initial
        """The current delay (seconds), before jitter."""

    def next_wait(self, *, lasted: float | None, retry_after: float | None) -> float:
        """The wait after a session that was authenticated for ``lasted`` seconds (None:
        it never was) and ended by a RECONNECT with ``retry_after`` (None: it failed)."""
        if lasted is not None and lasted > self.LONG_SESSION * self.maximum:
            self.delay = self.initial
        delay = self.delay
        self.delay = min(delay * 2, self.maximum)
        if retry_after is None:
            return self._random() * delay
        base = max(retry_after, delay)
        return base * (1.0 + 0.5 * self._random())

    def less(self, wait: float, waited: float) -> float:
        """``wait`` less ``waited``, the time an attempt spent on a TCP dial nobody
        answered (it waited already), but at least ``initial`` times a random draw (and
        never more than ``wait``). Clients whose dials timed out together are kept apart
        mostly by their redials' own jitter (REDIAL)."""
        if waited <= 0:
            return wait
        return min(wait, max(wait - waited, self._random() * self.initial))
