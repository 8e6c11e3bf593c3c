"""aioquic, set up for p2pdist: mutual TLS pinned to endpoint ids and a real receive window.

:class:`PinnedQuicConnection` is aioquic's sans-I/O ``QuicConnection`` with these
changes, each relying on an aioquic internal (hence the ``aioquic>=1.7,<2`` pin;
``tests/test_quic_transport.py`` has a test per internal that fails when aioquic changes it):

1. **Client certificates.** aioquic servers never ask for one. Its TLS context can:
   ``tls.Context._request_client_certificate`` (documented "for test purposes") makes the
   server send CertificateRequest, and the context then verifies the client's
   CertificateVerify signature against the presented certificate. We set it in
   ``_initialize``, where aioquic creates the context. The presented certificate is read
   from ``tls.Context._peer_certificate`` after the handshake and pinned to an endpoint id
   by the glue (:mod:`.quic`). A client that sends no certificate completes the TLS
   handshake with ``_peer_certificate`` unset, and the glue refuses it.
2. **Receive window.** aioquic doubles a stream's MAX_STREAM_DATA whenever half of it was
   received, and hands every byte to the application at once: the receiver could never
   push back. ``_write_stream_limits`` is replaced by a sliding window: the peer may send
   ``stream_window`` bytes beyond what we consumed, and nothing more while
   :attr:`receive_paused` (the mailbox is full) is set.
3. **Introspection.** :meth:`unsent` (send backpressure) and :meth:`send_acked` (a close
   that waits for the peer to have everything) read the stream's sender; :meth:`ending`
   reads the pending close; :attr:`smoothed_rtt` reads the loss recovery's estimate.
4. **Path changes and outages.** :meth:`path_changed` sets the datagram size
   (``_max_datagram_size``, also the pacer's) and resets the probe-timeout count
   (``_loss._pto_count``) when hole punching moves the connection between the relay and
   a direct path. :meth:`handle_timer` caps that count's backoff at
   :data:`MAX_PROBE_INTERVAL` (aioquic doubles it without bound). Each path gets its own
   congestion controller (``_loss._cc``, from aioquic's registry, to which
   :mod:`.bbr` adds ``"bbr"``), and BBR its own pacer (``_loss._pacer``): see
   :meth:`QuicConfig.congestion_control_for`; ``"auto"`` installs BBR in
   :meth:`datagrams_to_send` once the path's round trip (``_loss._rtt_min``, over
   the round trip after the first sample) is long enough. :meth:`datagrams_to_send`
   tells BBR when the sender ran out of data (``_pacing_at`` says whether pacing held
   it back, each stream's ``sender.buffer_is_empty`` whether data waits).
5. **One stream, a small window until admitted.** The peer may open no stream but 0
   (``_local_max_streams_bidi`` and ``_local_max_streams_uni``, aioquic's ``Limit``
   objects, set before the transport parameters go out): a frame on another stream ends
   the connection with STREAM_LIMIT_ERROR before aioquic stores anything for it (it
   stores data past a gap by padding the gap with real memory). Stream 0's initial
   window (``_local_max_stream_data_bidi_local`` / ``_remote``) is
   :data:`UNPROVEN_WINDOW` until :meth:`admit`, then the sliding window grows it.
6. **Loss detection.** ``_loss`` is replaced, right after aioquic made it, by a
   :class:`~.reordering.ReorderingRecovery` made with the same arguments: aioquic's
   loss recovery with a reordering window (it overrides ``on_ack_received``,
   ``_detect_loss``, ``_on_packets_lost`` and ``discard_space``, and calls
   ``_in_persistent_congestion``); :meth:`path_changed` tells it of a new path.
7. **Logging.** aioquic logs through ``self._logger`` (and ``_loss._logger``, handed
   the same adapter) and warns of every protocol error
   a peer makes, a stranger's late or forged Initial included; with no logging set up,
   Python prints such warnings on stderr. The connection logs under
   ``p2pdist.transport.quic_core.aioquic`` instead, warnings and errors at INFO: the
   transport reports what ends a connection itself, naming the peer.
"""

from __future__ import annotations

import enum
import logging
import ssl
from dataclasses import dataclass
from typing import Any, cast

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion.base import QuicCongestionControl, create_congestion_control
from aioquic.quic.connection import (
    MAX_STREAM_DATA_FRAME_CAPACITY,
    QuicConnection,
    QuicConnectionAdapter,
    QuicConnectionState,
)
from aioquic.quic.events import ConnectionTerminated
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketPacer, QuicPacketSpace
from aioquic.quic.stream import QuicStream
from aioquic.tls import CipherSuite
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from ..identity import SecretKey
from .bbr import NAME as BBR
from .bbr import BbrCongestionControl, RatePacer
from .pathinfo import LossInfo
from .reordering import ReorderingRecovery

__all__ = [
    "ALPN",
    "MAX_PROBE_INTERVAL",
    "AppError",
    "PinnedQuicConnection",
    "QuicConfig",
    "quic_configuration",
]

ALPN = "p2pdist/1"
"""The TLS application protocol both ends must offer."""

MAX_DATAGRAM = 16384
"""Largest datagram we let aioquic build: QUIC needs 1200, and aioquic writes a STREAM
frame's length in a 2-byte varint (at most 16383 bytes), so a larger datagram would hold a
frame it cannot encode."""

CID_LENGTH = 8
"""Length of our QUIC connection ids (aioquic's default), bytes."""


class AppError(enum.IntEnum):
    """QUIC application error codes in CONNECTION_CLOSE (the reason phrase says more)."""

    NO_ERROR = 0x0
    """Orderly close (after GOODBYE and the end of the stream)."""
    REFUSED = 0x1
    """Authentication failed or the accept policy refused the peer."""
    PROTOCOL = 0x2
    """The peer broke the p2pdist frame protocol."""
    ABORTED = 0x3
    """Any other local failure (keepalive timeout, ...)."""


MAX_PROBE_INTERVAL = 2.0
"""Longest wait between probes of a connection whose packets go unacknowledged, seconds.
RFC 9002 doubles the probe timeout after every probe that goes unanswered, and aioquic
without bound: after a 20 s outage the next probe was up to 20 s away (and the peer's as
far), so peers whose path had come back stayed silent past the transport's 30 s
``idle_timeout``. Past this bound probes repeat at this interval instead: one or two small
packets every 2 s, while nothing is acknowledged (on a path whose probe timeout is over
1 s already, at twice that: the backoff always doubles once)."""


@dataclass(frozen=True, slots=True)
class QuicConfig:
    """QUIC settings (sizes in bytes). Defaults are tuned for bulk arrays on loopback and
    LAN; see benchmarks/quic_throughput.py."""

    stream_window: int = 16 << 20
    """Receive window of our stream: how far the peer may send beyond what we consumed."""
    connection_window: int = 64 << 20
    """Initial connection-wide receive window (aioquic raises it as it is used)."""
    loopback_datagram: int = 16384
    """Largest QUIC datagram to a loopback address (loopback has no 1500-byte MTU)."""
    direct_datagram: int = 1452
    """Largest QUIC datagram on other direct IPv4 paths (1500-byte MTU minus IPv6 + UDP
    headers: 20 bytes spare for IPv4, as PPPoE's 1492-byte MTU needs)."""
    direct_datagram_ipv6: int = 1432
    """Largest QUIC datagram on direct IPv6 paths: a 1480-byte packet, which PPPoE and
    6in4/6rd tunnels (common for home IPv6) still carry whole."""
    relay_datagram: int = 16384
    """Largest QUIC datagram through a relay (also capped by the relay's ``max_datagram``)."""
    congestion_control: str = "auto"
    """The congestion controller: ``"reno"`` or ``"cubic"`` (aioquic's), ``"bbr"``
    (:mod:`p2pdist.transport.bbr`), or ``"auto"``: BBR on direct paths to other hosts
    whose measured round trip is :data:`BBR_MIN_RTT` or more (internet paths,
    where loss is often noise that Reno mistakes for congestion), Reno elsewhere: through
    a relay (a TCP session below: no random loss reaches QUIC), on loopback, and on LANs
    (round trips the event loops' scheduling swamps; BBR took 2-3 times Reno's time
    there). A direct path starts on Reno and moves to BBR once its round trip is known
    (see :meth:`PinnedQuicConnection.datagrams_to_send`)."""
    cipher_suites: tuple[CipherSuite, ...] = (
        CipherSuite.AES_128_GCM_SHA256,
        CipherSuite.AES_256_GCM_SHA384,
        CipherSuite.CHACHA20_POLY1305_SHA256,
    )
    """In order of preference (AES-128-GCM first: the fastest with AES-NI)."""
    max_pending_handshakes: int = 256
    """Incoming handshakes in progress beyond which new Initial packets are dropped."""

    def __post_init__(self) -> None:
        names = ("loopback_datagram", "direct_datagram", "direct_datagram_ipv6", "relay_datagram")
        for name in names:
            if not 1200 <= getattr(self, name) <= MAX_DATAGRAM:
                raise ValueError(f"{name} must be within 1200..{MAX_DATAGRAM}")
        if self.stream_window < 65536 or self.connection_window < self.stream_window:
            raise ValueError("need 64 KiB <= stream_window <= connection_window")
        if self.congestion_control not in CONGESTION_CONTROLS:
            raise ValueError(
                f"congestion_control must be one of {', '.join(CONGESTION_CONTROLS)},"
                f" not {self.congestion_control!r}"
            )

    def congestion_control_for(self, *, direct: bool, loopback: bool) -> tuple[str, float | None]:
        """The controller a path starts with, and the round trip (seconds) from which
        ``"auto"`` moves it to BBR once the path's first one is measured (None: never)."""
        if self.congestion_control != "auto":
            return self.congestion_control, None
        return "reno", (BBR_MIN_RTT if direct and not loopback else None)


CONGESTION_CONTROLS = ("auto", "reno", "cubic", "bbr")

BBR_MIN_RTT = 0.01
"""Shortest round trip on which ``"auto"`` runs BBR, seconds (see
:attr:`QuicConfig.congestion_control`)."""


def quic_configuration(
    key: SecretKey,
    certificate: x509.Certificate,
    config: QuicConfig,
    *,
    is_client: bool,
    max_datagram: int,
    idle_timeout: float,
    congestion_control: str,
) -> QuicConfiguration:
    """The aioquic configuration of one connection: ``certificate`` (``key``'s, from
    :func:`p2pdist.tls.make_certificate`), no CA, our ALPN, and the congestion controller
    of its first path (see :meth:`QuicConfig.congestion_control_for`)."""
    return QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        connection_id_length=CID_LENGTH,
        idle_timeout=idle_timeout,
        max_data=config.connection_window,
        max_stream_data=config.stream_window,
        max_datagram_size=max_datagram,
        congestion_control_algorithm=congestion_control,
        cipher_suites=list(config.cipher_suites),
        # No CA can vouch for a self-signed key: the glue pins the certificate's key to
        # the expected endpoint id after the handshake. Signatures are still verified.
        verify_mode=ssl.CERT_NONE,
        certificate=certificate,
        private_key=key.private_key(),
    )


AIOQUIC_LOG = logging.getLogger(__name__ + ".aioquic")

UNPROVEN_WINDOW = 64 * 1024
"""Receive window of a connection whose peer is not admitted yet (see ``admit``)."""


class _AioquicLog(QuicConnectionAdapter):
    """aioquic's per-connection log (``[connection id] message``) with warnings and errors
    lowered to INFO (module docstring, item 7)."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(min(level, logging.INFO), msg, *args, **kwargs)


def _pacer_for(cc: QuicCongestionControl, max_datagram: int) -> QuicPacketPacer:
    """The pacer for ``cc``: BBR's paces at its model's rate, aioquic's at window /
    smoothed RTT."""
    if isinstance(cc, BbrCongestionControl):
        return RatePacer(cc, max_datagram_size=max_datagram)
    return QuicPacketPacer(max_datagram_size=max_datagram)


class PinnedQuicConnection(QuicConnection):
    """aioquic's QuicConnection that asks for client certificates and has a sliding,
    pausable receive window (see the module docstring for the internals it uses)."""

    def __init__(
        self,
        *,
        configuration: QuicConfiguration,
        stream_window: int,
        original_destination_connection_id: bytes | None = None,
    ) -> None:
        super().__init__(
            configuration=configuration,
            original_destination_connection_id=original_destination_connection_id,
        )
        self._logger = _AioquicLog(AIOQUIC_LOG, self._logger.extra)
        # aioquic's loss recovery, as aioquic makes it, but adapting to reordering.
        self._loss: ReorderingRecovery = ReorderingRecovery(
            congestion_control_algorithm=configuration.congestion_control_algorithm,
            initial_rtt=configuration.initial_rtt,
            max_datagram_size=self._max_datagram_size,
            peer_completed_address_validation=not self._is_client,
            quic_logger=self._quic_logger,
            send_probe=self._send_probe,
            logger=self._logger,
        )
        self._loss._pacer = _pacer_for(self._loss._cc, self._max_datagram_size)
        # One stream, 0, opened by the dialer: the peer may open no other. aioquic would
        # otherwise let it open 128 of each kind, each with a full window, and it stores
        # data that arrives past a gap by padding the gap with real memory: a few bytes
        # at offset window-1 on each of 256 streams would pin 4 GiB here.
        for limit, allowed in (
            (self._local_max_streams_uni, 0),
            (self._local_max_streams_bidi, 0 if configuration.is_client else 1),
        ):
            limit.value = limit.sent = allowed
        # Until the peer is admitted (its certificate checked: admit()), it may send only
        # UNPROVEN_WINDOW bytes: a stranger that sends data past a gap with its Finished
        # pins that much, not a whole window, per handshake.
        self._full_window = stream_window
        self.stream_window = min(stream_window, UNPROVEN_WINDOW)
        self._local_max_stream_data_bidi_local = self.stream_window
        self._local_max_stream_data_bidi_remote = self.stream_window
        self.receive_paused = False
        """While True, the peer gets no more credit (backpressure from the mailbox)."""
        self.congestion_control = configuration.congestion_control_algorithm
        """The current path's congestion controller, by its name in aioquic's registry."""
        self.bbr_from_rtt: float | None = None
        """While set, the path moves to BBR if its round trip, the least measured during
        the round trip after its first sample, is at least this long, seconds
        (``congestion_control="auto"``; see :meth:`datagrams_to_send`)."""
        self._written: dict[int, int] = {}

    def admit(self) -> None:
        """The peer proved the identity we accept: it gets the whole receive window,
        granted (MAX_STREAM_DATA) with the next packet, as the window slides. (Stream 0
        starts with the credit the transport parameters gave, whenever it opens: a
        stream must not believe it granted more than the peer was told.)"""
        self.stream_window = self._full_window

    # ---- aioquic overrides --------------------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream
    ) -> None:
        # Replaces aioquic's "double the limit when half is used" with a sliding window
        # over what was consumed, updated in steps of 1/8 window, frozen while paused.
        if stream.max_stream_data_local and not self.receive_paused:
            target = stream.receiver.starting_offset() + self.stream_window
            if target - stream.max_stream_data_local >= self.stream_window // 8:
                stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            assert stream.stream_id is not None
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local

    # ---- what the glue reads -------------------------------------------------------------

    def peer_certificate_der(self) -> bytes | None:
        """The certificate the peer presented in the TLS handshake (DER), if any."""
        cert = self.tls._peer_certificate
        return None if cert is None else cert.public_bytes(Encoding.DER)

    def write(
        self, stream_id: int, data: bytes | bytearray | memoryview, end_stream: bool = False
    ) -> None:
        """Queue ``data`` on a stream. aioquic copies it into the stream's send buffer, so
        any bytes-like object works and the caller may reuse its buffer at once."""
        self.send_stream_data(stream_id, cast(bytes, data), end_stream)
        self._written[stream_id] = self._written.get(stream_id, 0) + len(data)

    def unsent(self, stream_id: int) -> int:
        """Bytes written to the stream that have not been put in a packet yet."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return self._written.get(stream_id, 0) - stream.sender.highest_offset

    def unacked(self, stream_id: int) -> int:
        """Bytes written to the stream that the peer has not acknowledged yet (those not
        yet sent, without aioquic's ``_buffer_start``, which is not public API)."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        acked = getattr(stream.sender, "_buffer_start", None)
        if not isinstance(acked, int):
            return self.unsent(stream_id)
        return self._written.get(stream_id, 0) - acked

    def send_acked(self, stream_id: int) -> bool:
        """Whether the peer acknowledged everything we sent on the stream, FIN included."""
        stream = self._streams.get(stream_id)
        return stream is None or stream.sender.is_finished

    def ending(self) -> tuple[ConnectionTerminated, bool] | None:
        """``(close event, by_peer)`` once a close began (by us, by the peer, or by aioquic
        on a protocol violation or idle timeout); ``by_peer`` is True when the peer sent
        CONNECTION_CLOSE."""
        ev = self._close_event
        if ev is None:
            return None
        return ev, self._state is QuicConnectionState.DRAINING

    def handle_timer(self, now: float) -> None:
        """aioquic's timer handling, with the probe backoff capped at
        :data:`MAX_PROBE_INTERVAL` (the base probe timeout itself is never cut, and
        doubles at least once)."""
        super().handle_timer(now)
        loss = self._loss
        # Down to one doubling, not none: on a path whose probe timeout is over 1 s
        # already, unanswered probes still back off (RFC 9002 section 6.2.1).
        while (
            loss._pto_count > 1
            and loss.get_probe_timeout() * 2**loss._pto_count > MAX_PROBE_INTERVAL
        ):
            loss._pto_count -= 1

    def path_changed(
        self,
        max_datagram: int,
        now: float,
        congestion_control: str,
        bbr_from_rtt: float | None = None,
    ) -> None:
        """Datagrams take another path from now on (the route below changed): build them
        at most ``max_datagram`` bytes long, restart the probe-timeout backoff (what was
        lost on the old path is resent promptly on the new one), and start congestion
        control (with ``congestion_control``, this path's controller; see
        :attr:`bbr_from_rtt`) and the RTT estimate afresh for the new path (RFC 9000
        section 9.4): the old path's window counted in its own datagram size (16 KiB
        through a relay against 1452 bytes direct) and its RTT belongs to another route."""
        self._max_datagram_size = max_datagram
        self._install_controller(congestion_control, now)
        self.bbr_from_rtt = bbr_from_rtt
        self._loss.new_path(self._packet_number)

    def _install_controller(self, name: str, now: float) -> None:
        """A fresh congestion controller (and its pacer), taking over what is in flight."""
        self.congestion_control = name
        loss = self._loss
        old = loss._cc
        cc = create_congestion_control(name, max_datagram_size=self._max_datagram_size)
        cc.bytes_in_flight = old.bytes_in_flight  # still to be acknowledged or lost
        # Losses of packets sent before are not this controller's congestion.
        if hasattr(cc, "_congestion_recovery_start_time"):  # reno, cubic
            cc._congestion_recovery_start_time = now
        loss._cc = cc
        loss._pacer = _pacer_for(cc, self._max_datagram_size)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        """aioquic's, moving the path to BBR once its round trip is measured and long
        enough (:attr:`bbr_from_rtt`), and telling a BBR controller when the sender
        ran out of data (stopped with room in the window, not held back by pacing): its
        rate samples until then measure the application, not the path."""
        threshold, loss = self.bbr_from_rtt, self._loss
        if threshold is not None and loss._rtt_initialized:
            # Decided on the least round trip seen until one more of them has passed
            # since the first sample: right after a path change the first ACKs can be
            # for packets sent on the old path (the relay's round trip), and a stalled
            # event loop can stretch one sample. A short one decides at once.
            if loss._rtt_min < threshold:
                self.bbr_from_rtt = None
            elif now >= loss._rtt_first_sample_time + loss._rtt_min:
                self.bbr_from_rtt = None
                self._install_controller(BBR, now)
        datagrams = super().datagrams_to_send(now)
        cc = self._loss._cc
        if (
            isinstance(cc, BbrCongestionControl)
            and cc.congestion_window - cc.bytes_in_flight >= self._max_datagram_size
            # pacing holds back only data; a side that sends ACKs only is always "paced"
            and (self._pacing_at is None or self._nothing_to_send())
        ):
            cc.on_app_limited()
        return datagrams

    def _nothing_to_send(self) -> bool:
        return all(stream.sender.buffer_is_empty for stream in self._streams.values())

    @property
    def loss_info(self) -> LossInfo:
        """Congestion control and loss detection as :class:`~.pathinfo.LossInfo`."""
        loss = self._loss
        return LossInfo(
            self.congestion_control, loss.packets_lost, loss.spurious_losses, loss.reordering
        )

    @property
    def smoothed_rtt(self) -> float | None:
        """aioquic's smoothed round-trip time, seconds (None before the first sample)."""
        loss = self._loss
        return loss._rtt_smoothed if loss._rtt_initialized else None

    @property
    def min_rtt(self) -> float | None:
        """The least round trip seen on the current path, seconds (None before the first
        sample; a path change starts over)."""
        loss = self._loss
        return loss._rtt_min if loss._rtt_initialized else None

    @property
    def address_validated(self) -> bool:
        """Whether the peer proved that it receives at its address (RFC 9000 section 8.1).
        Until then we may send it at most three times what it sent; aioquic keeps to that
        for its packets, but not for a CONNECTION_CLOSE."""
        paths = self._network_paths
        return bool(paths) and paths[0].is_validated

    @property
    def decrypted_any(self) -> bool:
        """Whether a packet from the peer was decrypted yet (else it may be garbage)."""
        return self._state is not QuicConnectionState.FIRSTFLIGHT

    @property
    def is_closing(self) -> bool:
        """True once the connection closes or has closed."""
        return self._close_event is not None
