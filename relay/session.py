"""One client connection as the core sees it: its phase, its buffers and its limits.

A :class:`Session` moves through :class:`Phase` in one direction only::

    HTTP --101--> AUTH --AUTH_OK--> ACTIVE
      \\             \\                 \\
       `-------------`-----------------`--> CLOSED

The asyncio glue gives each session a :class:`Link` (write, buffered, close); the core
(:mod:`relay.state`) does everything else, so tests can drive sessions with fake links
and a hand-moved clock.
"""

from __future__ import annotations

import enum
from typing import Protocol

from p2pdist.identity import EndpointId
from p2pdist.wire.relay import RelayFrameDecoder

from .limits import PeerGoneThrottle, TokenBucket

__all__ = ["Link", "Phase", "Session"]


class Link(Protocol):
    """What the core needs from a client connection."""

    def write(self, data: bytes) -> None:
        """Queue bytes for the client (never blocks)."""

    def buffered(self) -> int:
        """Bytes written but not yet handed to the socket."""

    def close(self) -> None:
        """Flush what is queued (bounded by the glue), then close."""


class Phase(enum.Enum):
    """Where a connection is in its life."""

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
        "decoder",
        "endpoint",
        "http_buf",
        "last_heard",
        "link",
        "observed",
        "opened_at",
        "out",
        "out_bytes",
        "peer_gone",
        "phase",
        "raw_id",
    )

    def __init__(self, conn_id: int, link: Link, observed: str, now: float) -> None:
        self.conn_id = conn_id
        self.link = link
        self.observed = observed
        self.opened_at = now
        self.last_heard = now
        self.phase = Phase.HTTP
        self.http_buf = bytearray()
        self.decoder = RelayFrameDecoder()
        self.challenge = b""
        self.endpoint: EndpointId | None = None
        self.raw_id = b""
        self.bucket: TokenBucket | None = None
        self.peer_gone = PeerGoneThrottle()
        self.out: list[bytes] = []
        self.out_bytes = 0

    @property
    def label(self) -> str:
        """``c12`` before authentication, ``c12/abcdefghij`` after (for log lines)."""
        if self.endpoint is None:
            return f"c{self.conn_id}"
        return f"c{self.conn_id}/{self.endpoint.short()}"

    def queued(self) -> int:
        """Bytes towards this client not yet on the socket (link buffer + this batch)."""
        return self.link.buffered() + self.out_bytes

    def __repr__(self) -> str:
        return f"Session({self.label}, {self.phase.value})"
