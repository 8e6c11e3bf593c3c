"""What a caller can see of the way to each peer: :class:`PathInfo` and :class:`PathStats`."""

from __future__ import annotations

from dataclasses import dataclass

from ..identity import EndpointId
from .base import ConnectionStats
from .paths import PathKind

__all__ = ["LossInfo", "PathInfo", "PathStats", "single_path"]


@dataclass(frozen=True, slots=True)
class PathStats:
    """Traffic on one path to a peer (a direct ip:port, or the relay)."""

    kind: PathKind
    remote: str
    """``ip:port`` for a direct path, ``relay`` for the relay; ``earlier paths`` sums
    the direct paths past the last :data:`~.paths.MAX_PATH_COUNTERS`."""
    active: bool
    """Whether datagrams go this way now."""
    datagrams_sent: int = 0
    bytes_sent: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    rtt: float | None = None
    """Smoothed PING round trip on a direct path, seconds (None for the relay)."""


@dataclass(frozen=True, slots=True)
class LossInfo:
    """A QUIC connection's congestion control and loss detection (docs/quic.md 4)."""

    congestion_control: str
    """The current path's controller: ``"reno"``, ``"bbr"`` or ``"cubic"``."""
    packets_lost: int = 0
    """Packets declared lost since the connection began (a probe's early resend not
    counted)."""
    spurious_losses: int = 0
    """Of those, packets acknowledged after all: the path reorders them."""
    reordering: bool = False
    """The current path has shown reordering: losses are declared by time only."""


@dataclass(frozen=True, slots=True)
class PathInfo:
    """How we reach one peer right now."""

    peer: EndpointId
    kind: PathKind
    """``"direct"`` or ``"relay"``: where our datagrams (or TCP stream) go now."""
    remote: str
    """The peer's ``ip:port`` on a direct path, ``relay <url>`` on the relay."""
    rtt: float | None
    """Smoothed round-trip time, seconds: QUIC's estimate (TCP: the kernel's on Linux,
    else the last keepalive's)."""
    transport: str
    """``"tcp"`` or ``"quic"``."""
    paths: tuple[PathStats, ...] = ()
    """Traffic per path (QUIC); a TCP connection has one path."""
    punching: str = "off"
    """Hole punching towards the peer: ``off``, ``idle``, ``punching``, ``direct`` or
    ``backoff`` (waiting to try again)."""
    changes: int = 0
    """How many times the path changed."""
    last_failure: str | None = None
    """Why the last punching round or direct path failed, if one did."""
    loss: LossInfo | None = None
    """QUIC: congestion control and loss detection (None for TCP)."""


def single_path(
    peer: EndpointId,
    remote: str,
    stats: ConnectionStats,
    rtt: float | None,
    transport: str,
    loss: LossInfo | None = None,
    *,
    traffic: tuple[int, int, int, int] | None = None,
) -> PathInfo:
    """A peer reached over one direct path (TCP, or QUIC dialed at an address), with
    ``traffic`` (datagrams and bytes sent, then received: QUIC's) as the path's, else the
    connection's frame counters (TCP has no datagrams), and QUIC's ``loss``."""
    sent, sent_bytes, got, got_bytes = traffic or (
        stats.frames_sent,
        stats.bytes_sent,
        stats.frames_received,
        stats.bytes_received,
    )
    only = PathStats("direct", remote, True, sent, sent_bytes, got, got_bytes, rtt)
    return PathInfo(peer, "direct", remote, rtt, transport, (only,), loss=loss)
