"""p2pdist: peer-to-peer collectives over authenticated transports, addressed by endpoint id."""

from .errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    GroupBrokenError,
    KeyFileError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from .group import ErrorFeedback, GradientBuckets, Group, GroupConfig
from .identity import EndpointId, SecretKey, derive_endpoint_ids
from .transport import PathInfo, PunchConfig, TcpTransport, TransportConfig

__version__ = "0.1.0"

__all__ = [
    "ConnectionBrokenError",
    "ConnectionClosedError",
    "EndpointId",
    "ErrorFeedback",
    "GradientBuckets",
    "Group",
    "GroupBrokenError",
    "GroupConfig",
    "KeyFileError",
    "MismatchError",
    "P2PError",
    "P2PTimeoutError",
    "PathInfo",
    "PeerAuthenticationError",
    "PeerError",
    "PeerTimeoutError",
    "PunchConfig",
    "RemoteProtocolError",
    "SecretKey",
    "TcpTransport",
    "TransportConfig",
    "UsageError",
    "derive_endpoint_ids",
]
