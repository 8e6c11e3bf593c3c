"""The transport interface (typing.Protocol) and its configuration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..errors import PeerAuthenticationError, UsageError
from ..identity import EndpointId
from ..settings import check_int, check_seconds
from ..wire.frames import Frame, FrameLimits

__all__ = [
    "IDENTITY_MISMATCH",
    "is_identity_mismatch",
    "NOT_ADMITTED",
    "Address",
    "Connection",
    "ConnectionStats",
    "Transport",
    "TransportConfig",
]

NOT_ADMITTED = "is not allowed to connect here"
"""The end of the reason a transport gives a peer its ``accept_from`` refuses (after
"endpoint ID"); the dialer's error carries it."""
ACCEPT_QUEUE_FULL = "accept queue full"
"""Why a dial is refused while ``TransportConfig.max_accept_queue`` connections wait for
``accept()`` (a passing state: the dialer may try again)."""


IDENTITY_MISMATCH = "identity mismatch"
"""How a handshake says the other end is another endpoint than the one dialed."""


def is_identity_mismatch(exc: BaseException) -> bool:
    """Whether a dial failed because the other end is another endpoint (a stale address,
    another seed's key): as opposed to the peer itself refusing or failing."""
    return isinstance(exc, PeerAuthenticationError) and IDENTITY_MISMATCH in exc.detail


def routine_refusal(reason: str) -> bool:
    """Whether a refusal is routine, logged at info: the accept policy's (a group member
    re-forming while this process still runs its earlier group dials until it closes)
    or a full accept queue's (the dialer tries again)."""
    return NOT_ADMITTED in reason or ACCEPT_QUEUE_FULL in reason


Address = str | tuple[str, int]
"""A network address: ``"host:port"``, ``"[v6]:port"`` or ``(host, port)``."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Settings shared by all transports. Times are seconds, sizes bytes."""

    tls: bool = True
    """Encrypt with TLS 1.3. ``False`` is plaintext (still authenticated by signatures):
    only for trusted networks such as one machine or a private cluster fabric."""
    sealed_records: bool = True
    """TLS mode, TCP: after the TLS handshake, protect frames with AES-256-GCM records
    under keys agreed inside TLS (``cryptography``'s AES-GCM, about 3x faster here than
    the system OpenSSL's under ``ssl``) instead of TLS records. Used when both ends
    offer it; ``False`` keeps TLS records (docs/security.md)."""
    limits: FrameLimits = field(default_factory=FrameLimits)
    handshake_timeout: float = 10.0
    keepalive_interval: float = 1.0
    """Send a PING when we have sent nothing for this long."""
    idle_timeout: float = 30.0
    """Declare the peer dead when nothing arrived from it for this long."""
    max_buffered: int = 512 * 1024 * 1024
    """Received-but-unconsumed bytes per connection before we stop reading (backpressure;
    twice this while a receiver waits for a message, which on a group's connections is
    always, and four times it while a sender of the group waits for its peer to read:
    see docs/architecture.md section 7)."""
    write_buffer_high: int = 8 * 1024 * 1024
    """Outgoing bytes queued in user space before ``send`` waits for the socket."""
    max_pending_handshakes: int = 256
    """Incoming TCP connections still handshaking (not yet authenticated); past it the
    oldest (of the address holding the most) makes way if it has waited a second, else
    the new one is closed at once; both counted in ``TcpTransport.refused_handshakes``.
    QuicTransport has its own limit, ``QuicConfig.max_pending_handshakes``."""
    max_accept_queue: int = 1024
    """Authenticated incoming connections that may wait for ``accept()`` (or
    ``take_accepted()``) at once (plus those finishing their handshake then); past it a
    dialer is refused "accept queue full", which ``dial_with_retry`` retries. A waiting
    connection reads nothing from its peer until it is handed out (over QUIC, at most
    the credit the peer had been given)."""

    def __post_init__(self) -> None:
        # Kept as plain numbers (numpy's are taken): they go into msgpack and formatting.
        for name in ("keepalive_interval", "idle_timeout", "handshake_timeout"):
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        if self.idle_timeout <= self.keepalive_interval:
            raise UsageError("need 0 < keepalive_interval < idle_timeout")
        for name in (
            "max_buffered",
            "write_buffer_high",
            "max_pending_handshakes",
            "max_accept_queue",
        ):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))


@dataclass(slots=True)
class ConnectionStats:
    """Counters of one connection."""

    frames_sent: int = 0
    """Messages sent (DATA frames; not keepalives nor the goodbye)."""
    bytes_sent: int = 0
    """Their frame headers, metas and payloads, before any encryption."""
    frames_received: int = 0
    """Frames received, keepalives and the goodbye included."""
    bytes_received: int = 0
    """Metas and payloads of the frames received (what ``max_buffered`` counts)."""
    dropped_stale: int = 0
    """Frames that arrived for a retired channel and were discarded."""
    landed_in_place: int = 0
    """Frames received straight into a place the receiver named (``expect``)."""
    buffered: int = 0
    """Bytes received and not yet taken by a receiver (as ``max_buffered`` counts them)."""
    reading_paused: bool = False
    """Whether reading from the peer is paused (backpressure: ``max_buffered``)."""
    rtt: float | None = None
    """Last keepalive round-trip time, seconds."""


@runtime_checkable
class Connection(Protocol):
    """An authenticated, ordered-per-channel message pipe to one peer."""

    label: str
    """How errors and logs name the peer (the Group sets ``"rank 2 (abcdefghij)"``)."""

    @property
    def peer_id(self) -> EndpointId:
        """The authenticated endpoint id of the peer (from the handshake, never a frame)."""
        ...

    @property
    def closed(self) -> bool:
        """True once the connection can no longer send."""
        ...

    @property
    def stats(self) -> ConnectionStats:
        """Counters."""
        ...

    @property
    def path_rtt(self) -> float | None:
        """The path's round-trip time as the transport measures it below the application
        (TCP: the kernel's least RTT; QUIC: the path's least RTT), else the keepalive's
        last; seconds, None before any measurement."""
        ...

    @property
    def receive_limit(self) -> int:
        """Bytes this end buffers for the application before it stops reading
        (``TransportConfig.max_buffered``)."""
        ...

    def idle_for(self) -> float:
        """Seconds since anything arrived from the peer."""
        ...

    async def send(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Queue one message on ``channel``; waits while the peer is not keeping up.

        While it does not, senders take turns, first come first served, and a sender
        hands over its whole message in its turn: one cancelled before then sent nothing,
        and a :meth:`send_nowait` meanwhile goes ahead of it (use :meth:`drain` first to
        keep the order)."""
        ...

    async def drain(self) -> None:
        """Wait until the peer keeps up again and the senders waiting before this call
        have gone (at once when none wait): after it, a :meth:`send_nowait` queues no
        more than a :meth:`send` would, and after theirs."""
        ...

    def send_nowait(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Queue one message without waiting (small control messages)."""
        ...

    def interrupt(self, error: BaseException) -> None:
        """Fail current and future receives and send waits with ``error``; stays open."""
        ...

    async def recv(self, channel: int, *, timeout: float | None = None) -> Frame:
        """The next message on ``channel`` (messages on one channel arrive in send order)."""
        ...

    def recv_nowait(self, channel: int) -> Frame | None:
        """The next message on ``channel`` if it has arrived, else None (never waits;
        what arrived before the connection ended stays readable)."""
        ...

    def expect(self, channel: int, seq: int, place: memoryview) -> None:
        """Receive message ``seq`` of ``channel`` straight into ``place`` (a writable 1-D
        byte view) when it arrives later and is exactly that long: its frame's payload is
        then ``place`` itself. A hint, never an error: any other message is received as
        usual. Places are dropped by :meth:`retire`."""
        ...

    def retire(self, channel: int) -> None:
        """Forget ``channel``: queued and later frames for it are dropped and counted, and
        places named for it with :meth:`expect` are let go."""
        ...

    def retire_space(self, space: int) -> None:
        """:meth:`retire` every channel of ``space`` (``channel >> 48``), those to come
        too (a sub-group this end has closed)."""
        ...

    def add_close_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once when the connection ends (None: closed by us)."""
        ...

    @property
    def end_error(self) -> BaseException | None:
        """Why the peer's side ended the connection (a goodbye is a ConnectionBrokenError
        with ``graceful``); None while it is open or when we closed it."""
        ...

    async def close(self) -> None:
        """Say goodbye and close; pending receivers get ConnectionClosedError."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Makes authenticated connections to peers named by endpoint id."""

    @property
    def endpoint_id(self) -> EndpointId:
        """Our own endpoint id."""
        ...

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Start accepting; returns the bound (host, port)."""
        ...

    async def connect(
        self, peer: EndpointId, address: Address, *, label: str | None = None
    ) -> Connection:
        """Dial ``address`` and authenticate that the other end is ``peer``."""
        ...

    async def accept(self, *, timeout: float | None = None) -> Connection:
        """The next authenticated incoming connection."""
        ...

    async def close(self) -> None:
        """Stop listening and close every connection."""
        ...
