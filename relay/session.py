"""One client connection as the core sees it: its phase, its buffers and its limits.

A :class:`Session` moves through :class:`Phase` in one direction only::

    TLS --handshake--> HTTP --101--> AUTH --AUTH_OK--> ACTIVE
      \\                  \\             \\                 \\
       `------------------`-------------`-----------------`--> CLOSED

(TLS on the TLS port, where the glue sees the TCP connection before its TLS handshake is
done; a connection on the plain HTTP port, from the operator's reverse proxy, starts in
HTTP.)

The asyncio glue gives each session a :class:`Link` (write, buffered, close); the core
(:mod:`relay.state`) does everything else, so tests can drive sessions with fake links
and a hand-moved clock.
"""

from __future__ import annotations

import enum
from typing import Protocol

from p2pdist.identity import EndpointId
from p2pdist.wire.relay import RelayFrameSplitter
from p2pdist.wire.websocket import WebSocketReader

from .limits import PeerGoneThrottle, TokenBucket

__all__ = ["Link", "Phase", "Session"]


class Link(Protocol):
    """What the core needs from a client connection."""

    def write(self, data: bytearray) -> None:
        """Queue bytes for the client (never blocks); the core never touches ``data``
        again, so the link may keep it instead of copying it."""

    def buffered(self) -> int:
        """Bytes written but not yet handed to the socket."""

    def close(self) -> None:
        """Flush what is queued (bounded by the glue), then close."""

    def pause(self, seconds: float) -> None:
        """Read nothing from the client for ``seconds`` (its rate limit: TCP then holds
        back what it sends); a pause under way is not extended."""

    def secure(self, records: tuple[bytes, bytes] | None) -> None:
        """Called once, right after the 101 was written: None keeps TLS for the data;
        (relay's secret, client's secret) moves both directions to AES-GCM records from
        the next byte on (docs/protocol.md 8.2). A glue that cannot drops the link."""


class Phase(enum.Enum):
    """Where a connection is in its life."""

    TLS = "tls"  # TCP accepted, TLS handshake in progress (nothing to read or write)
    HTTP = "http"  # reading the request head
    AUTH = "auth"  # CHALLENGE sent, waiting for AUTH
    ACTIVE = "active"  # authenticated: forwarding
    CLOSED = "closed"  # closed by either side; ignored from now on


class Session:
    """State of one client connection (owned by :class:`relay.state.RelayCore`)."""

    __slots__ = (
        "bucket",
        "challenge",
        "conn_id",
        "endpoint",
        "frames_in",
        "http_buf",
        "last_heard",
        "link",
        "observed",
        "opened_at",
        "out",
        "peer_gone",
        "phase",
        "proxied",
        "raw_id",
        "ready_at",
        "shares",
        "shares_total",
        "source",
        "splitter",
        "websocket",
        "ws_before_auth",
    )

    def __init__(self, conn_id: int, link: Link, observed: str, now: float) -> None:
        self.conn_id = conn_id
        self.link = link
        self.observed = observed
        self.opened_at = now
        """When the connection was accepted (TCP, or TLS where TCP is not seen)."""
        self.ready_at = now
        """When its TLS handshake completed (the auth timeout runs from here)."""
        self.source = ""
        """The source address it counts against (see :func:`relay.addresses.source_of`)."""
        self.last_heard = now
        self.phase = Phase.HTTP
        self.http_buf = bytearray()
        self.splitter = RelayFrameSplitter()
        self.challenge = b""
        """The 32 random bytes sent in CHALLENGE (after the upgrade), which the
        client's AUTH signs (empty until then)."""
        self.endpoint: EndpointId | None = None
        self.raw_id = b""
        self.bucket: TokenBucket | None = None
        self.frames_in = 0
        """Relay and WebSocket frames received (each costs the relay a pass of Python)."""
        self.peer_gone = PeerGoneThrottle()
        self.out = bytearray()
        """Frames batched for this client during the current core call."""
        self.shares: dict[bytes, int] = {}
        """Bytes each sender added to this client's queue while it was over half full
        (see ``Inbound._fair_share``); emptied once it goes below half."""
        self.shares_total = 0
        """The sum of :attr:`shares`."""
        self.proxied = False
        """Whether it came through the plain HTTP port, from a TLS-terminating proxy."""
        self.websocket: WebSocketReader | None = None
        """Set once the upgrade chose WebSocket framing: the frames' reader."""
        self.ws_before_auth = 0
        """WebSocket bytes received before authentication (bounded by the core)."""

    @property
    def label(self) -> str:
        """``c12`` before authentication, ``c12/abcdefghij`` after (for log lines)."""
        if self.endpoint is None:
            return f"c{self.conn_id}"
        return f"c{self.conn_id}/{self.endpoint.short()}"

    def queued(self) -> int:
        """Bytes towards this client not yet on the socket (link buffer + this batch)."""
        return self.link.buffered() + len(self.out)

    def __repr__(self) -> str:
        return f"Session({self.label}, {self.phase.value})"
