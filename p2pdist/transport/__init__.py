"""Transports: how frames get from one endpoint to another.

:class:`~p2pdist.transport.base.Transport` and :class:`~p2pdist.transport.base.Connection`
are the interface every transport implements; :class:`TcpTransport` is the first one.
"""

from .base import Connection, ConnectionStats, Transport, TransportConfig
from .tcp import TcpTransport

__all__ = ["Connection", "ConnectionStats", "TcpTransport", "Transport", "TransportConfig"]
