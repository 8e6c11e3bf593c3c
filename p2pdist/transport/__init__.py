"""Transports: how frames get from one endpoint to another.

:class:`~p2pdist.transport.base.Transport` and :class:`~p2pdist.transport.base.Connection`
are the interface every transport implements: :class:`TcpTransport` (TLS or plaintext)
and :class:`QuicTransport` (over UDP, or a relay through :class:`RelayPath`).
"""

from .base import Connection, ConnectionStats, Transport, TransportConfig
from .pathinfo import LossInfo, PathInfo, PathStats
from .punch import PunchConfig
from .quic import QuicConnection, QuicTransport
from .relay_path import RelayPath
from .tcp import TcpTransport

__all__ = [
    "Connection",
    "ConnectionStats",
    "LossInfo",
    "PathInfo",
    "PathStats",
    "PunchConfig",
    "QuicConnection",
    "QuicTransport",
    "RelayPath",
    "TcpTransport",
    "Transport",
    "TransportConfig",
]
