"""The one exception tree of p2pdist.

Everything p2pdist raises on purpose derives from :class:`P2PError`:

* :class:`UsageError` - local misuse (bad arguments, wrong state); also a ``ValueError``.
* :class:`PeerError` - something about a specific remote peer; ``peer`` names it
  (``"rank 2 (k3q9x0ab)"``) so that every message says *which* peer.

  * :class:`RemoteProtocolError` - the peer sent bytes that break the protocol.
  * :class:`PeerAuthenticationError` - the peer is not who we expected (wrong key).
  * :class:`ConnectionBrokenError` - the peer went away (EOF, reset, keepalive silence).
  * :class:`PeerTimeoutError` - we waited for the peer too long; also a ``TimeoutError``.
  * :class:`MismatchError` - the peer sent an array or collective that differs from ours.

* :class:`P2PTimeoutError` - a bounded wait ran out; also a ``TimeoutError``.
* :class:`ConnectionClosedError` - we closed the connection/transport ourselves.
* :class:`GroupBrokenError` - an earlier failure left the group unusable; ``cause`` says why.
* :class:`KeyFileError` - a key file is missing, malformed or too permissive.
"""

from __future__ import annotations

__all__ = [
    "ConnectionBrokenError",
    "ConnectionClosedError",
    "GroupBrokenError",
    "KeyFileError",
    "MismatchError",
    "P2PError",
    "P2PTimeoutError",
    "PeerAuthenticationError",
    "PeerError",
    "PeerTimeoutError",
    "RemoteProtocolError",
    "UsageError",
]


class P2PError(Exception):
    """Root of every exception p2pdist raises on purpose."""

    exit_status = 2
    """The status the ``p2pdist`` command exits with when it ends on this error."""


class UsageError(P2PError, ValueError):
    """The caller misused the API (bad argument, wrong state)."""


class KeyFileError(P2PError):
    """A key file could not be used (missing, malformed, readable by others)."""


class ConnectionClosedError(P2PError):
    """The connection or transport was closed locally; it cannot be used any more."""


class PeerError(P2PError):
    """An error attributable to one remote peer, named in ``peer``; ``detail`` is the
    message without the peer's name."""

    def __init__(self, peer: str, message: str) -> None:
        self.peer = peer
        self.detail = message
        super().__init__(f"{peer}: {message}")


class RemoteProtocolError(PeerError):
    """The peer sent something the protocol does not allow (a malformed or unexpected
    frame or message). A transport that raises it has closed the connection; a protocol
    on top (a federated coordinator reading reports, say) may instead drop the one
    message and go on reading."""


class PeerAuthenticationError(PeerError):
    """The peer could not prove the identity we expected of it."""


class ConnectionBrokenError(PeerError):
    """The peer's connection broke (EOF, reset, or it stopped answering keepalives).

    ``graceful`` is True when the peer said goodbye first (it closed on purpose).
    ``corrupt`` is True when the byte stream failed its cryptographic check (a record
    that does not decrypt, or TLS's own error): altered in transit, or a broken peer.
    """

    def __init__(
        self, peer: str, message: str, *, graceful: bool = False, corrupt: bool = False
    ) -> None:
        super().__init__(peer, message)
        self.graceful = graceful
        self.corrupt = corrupt


class P2PTimeoutError(P2PError, TimeoutError):
    """A bounded wait ran out (not attributable to one peer)."""


class PeerTimeoutError(PeerError, P2PTimeoutError):
    """Waiting for the peer took longer than the configured timeout."""


class MismatchError(PeerError):
    """The peer's array or collective call does not match ours (dtype, shape, op, ...)."""


class GroupBrokenError(P2PError):
    """The group saw a failure and cannot run further collectives.

    ``cause`` is the original failure (for example the dead peer's error).
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        self.cause = cause
        super().__init__(message if cause is None else f"{message}: {cause}")
