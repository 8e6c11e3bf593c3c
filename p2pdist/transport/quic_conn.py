"""QUIC transport: aioquic (sans-I/O) over our own datagram paths, TLS 1.3 pinned both ways.

Each connection is one aioquic connection (:class:`~.quic_core.PinnedQuicConnection`)
carrying the p2pdist frames of :mod:`p2pdist.wire.frames` on one bidirectional stream
(stream 0, opened by the dialer), so all of :class:`~.framed.FramedConnection` (per-channel
order, keepalive, GOODBYE, backpressure) works as on TCP. This module is the thin glue:
it feeds received datagrams and timer expiries to aioquic (time from ``time.monotonic``,
which is asyncio's ``loop.time()``; uvloop's counts whole milliseconds, too coarse for
aioquic's RTT, pacing and loss timers on a fast path), acts on its events and sends what
it wants sent through the connection's :class:`~.paths.Route` (UDP or relay). Routing and
the transport live in :mod:`.quic`.

Authentication: both ends present their self-signed Ed25519 certificate
(:func:`p2pdist.tls.make_certificate`) and prove the key (TLS CertificateVerify).
After the handshake, the dialer requires the server's key to be the endpoint id it dialed;
the server requires a certificate, requires its key to be the relay-authenticated source
on the relay path, and asks ``accept_from``. A refusal closes the QUIC connection with
:attr:`AppError.REFUSED` and the reason, which the dialer raises as
:class:`~p2pdist.errors.PeerAuthenticationError`. The dialer sends a PING on the stream
right after its handshake; ``connect`` returns when the server's first bytes (the PONG)
arrive, that is once the server has accepted it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from time import monotonic as _now
from typing import TYPE_CHECKING, Any

from aioquic.quic import events
from aioquic.quic.packet import QuicErrorCode

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    PeerAuthenticationError,
    PeerError,
    PeerTimeoutError,
    RemoteProtocolError,
)
from ..identity import EndpointId
from ..tls import endpoint_id_of_cert
from .base import IDENTITY_MISMATCH
from .framed import FLUSH_STALL, FramedConnection
from .pathinfo import LossInfo
from .paths import PathKind, RelayRoute, Route, UdpAddress, UdpRoute
from .quic_core import AppError, PinnedQuicConnection

if TYPE_CHECKING:
    from .quic import QuicTransport

__all__ = ["QuicConnection"]

log = logging.getLogger(__name__)

STREAM_ID = 0
"""Our frames travel on the first client-initiated bidirectional stream."""
_MAX_REASON = 200


class QuicConnection(FramedConnection):
    """One QUIC connection to one authenticated peer (frames on one stream)."""

    def __init__(
        self,
        owner: QuicTransport,
        quic: PinnedQuicConnection,
        route: Route,
        *,
        server_side: bool,
        expected: EndpointId | None,
        label: str,
    ) -> None:
        super().__init__(
            owner.config,
            label=label,
            peer=expected,
            on_finish=owner._forget,
            stalls=owner.send_stalls,
        )
        self._owner = owner
        self._quic = quic
        self._route = route
        self._server_side = server_side
        self._authenticated = False
        self._stream_open = False
        self._fin_sent = False
        self._by_peer = False
        self._established: asyncio.Future[None] = self._loop.create_future()
        self._terminated: asyncio.Future[None] = self._loop.create_future()
        self._flushed: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_soon = False
        self._heard_direct_at = self._loop.time()
        """When the last datagram of this connection arrived on a direct path (ACKs too;
        for a connection through the relay, see :meth:`heard_directly`)."""
        self._fell_back_at = -math.inf
        """When the route last fell back from a direct path to the relay."""

    # ---- what this connection runs on ------------------------------------------------------

    @property
    def path_kind(self) -> PathKind:
        """``"direct"`` (UDP) or ``"relay"``: the path this connection's datagrams take."""
        return self._route.kind

    @property
    def remote_address(self) -> UdpAddress | EndpointId:
        """The peer's ip:port (direct path) or its endpoint id (relay path)."""
        return self._route.remote

    @property
    def route(self) -> Route:
        """The way this connection's datagrams go."""
        return self._route

    @property
    def dialing(self) -> bool:
        """True while our own dial has not authenticated the server yet."""
        return not self._server_side and not self._authenticated

    @property
    def decrypted_any(self) -> bool:
        """Whether any packet from the peer could be decrypted yet."""
        return self._quic.decrypted_any

    @property
    def established(self) -> bool:
        """Whether the handshake finished and frames flow."""
        return self._established.done() and self._established.exception() is None

    @property
    def encrypted(self) -> bool:
        """Always True: QUIC is always TLS 1.3."""
        return True

    # ---- FramedConnection hooks ----------------------------------------------------------

    def _write(self, data: bytes) -> None:
        self._quic.write(STREAM_ID, data)
        self._after_write()

    def _write_frame(self, header: bytes, payload: memoryview) -> None:
        if payload.nbytes <= 65536:
            # One copy (``header + payload.tobytes()`` made two), as TcpConnection does.
            self._quic.write(STREAM_ID, b"".join((header, payload)) if payload.nbytes else header)
        else:
            self._quic.write(STREAM_ID, header)
            self._quic.write(STREAM_ID, payload)
        self._after_write()

    def _writable(self) -> bool:
        return self._stream_open and not self._fin_sent and not self._quic.is_closing

    def _set_reading(self, on: bool) -> None:
        self._quic.receive_paused = not on
        if on:
            self._schedule_transmit()

    async def _shutdown(self) -> None:
        if self._quic.is_closing:
            return
        if self._stream_open and not self._fin_sent:
            self._fin_sent = True
            self._quic.write(STREAM_ID, b"", end_stream=True)
            self._transmit()
            if self._route.up:
                self._flushed = self._loop.create_future()
                self._check_flushed()
                left = await self._await_flush(self._flushed, lambda: self._quic.unacked(STREAM_ID))
                if left:  # the peer's error says so, not "ended in the middle of a frame"
                    self._close_quic(AppError.ABORTED, f"closed with {left} bytes undelivered")
                    return
        self._close_quic(AppError.NO_ERROR, "")

    def _drop(self) -> None:
        err = self._error
        code = AppError.ABORTED
        if isinstance(err, RemoteProtocolError):
            code = AppError.PROTOCOL
        elif isinstance(err, PeerAuthenticationError):
            code = AppError.REFUSED
        reason = str(err) if err is not None else ""
        if isinstance(err, PeerError):
            reason = reason.removeprefix(f"{err.peer}: ")
        self._close_quic(code, reason)

    # ---- driven by the transport ---------------------------------------------------------

    def start_client(self) -> None:
        """Send the first handshake flight (dialing side)."""
        self._quic.connect(self._route.quic_addr, now=_now())
        self._transmit()

    async def wait_established(self) -> None:
        """Until frames flow, or the handshake's error (PeerAuthenticationError, ...)."""
        await asyncio.shield(self._established)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        """A datagram for this connection arrived (the transport routed it here)."""
        self._quic.receive_datagram(data, addr, now=_now())
        self._process_events()
        self._schedule_transmit()

    def handshake_expired(self) -> None:
        """The handshake took longer than ``handshake_timeout`` (accepting side)."""
        if not self._established.done() and self._error is None:
            err = PeerTimeoutError(self.label, "handshake timed out")
            log.warning("%s: incoming handshake timed out", self.label)
            if self._quic.address_validated or not isinstance(self._route, UdpRoute):
                self._fail_handshake(err, AppError.ABORTED)
            else:
                # A peer that never answered over UDP may be a spoofed source: what we
                # sent it used up the 3x anti-amplification budget, so no closing
                # datagram. (Through the relay its endpoint id was authenticated.)
                self._finish(err)
                self.stop()

    def discard(self) -> None:
        """Forget a connection that never was one (its first datagram was garbage)."""
        self._finish(ConnectionClosedError(f"{self.label}: discarded"))
        self.stop()

    def stop(self) -> None:
        """Forget the QUIC connection without another datagram (transport closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        self._mark_terminated()

    # ---- events ------------------------------------------------------------------------------

    def _process_events(self) -> None:
        quic = self._quic
        while (ev := quic.next_event()) is not None:
            if isinstance(ev, events.StreamDataReceived):
                self._on_stream_data(ev)
            elif isinstance(ev, events.HandshakeCompleted):
                self._on_handshake_completed()
            elif isinstance(ev, events.ConnectionIdIssued):
                self._owner._route_cid(ev.connection_id, self)
            elif isinstance(ev, events.ConnectionIdRetired):
                self._owner._unroute_cid(ev.connection_id, self)
            elif isinstance(ev, events.StreamReset | events.StopSendingReceived):
                self.abort(ConnectionBrokenError(self.label, f"reset the stream ({ev.error_code})"))
            elif isinstance(ev, events.ConnectionTerminated):
                self._on_terminated(ev)
        ending = quic.ending()
        if ending is not None and not self._terminated.done():
            ev, by_peer = ending
            self._by_peer = self._by_peer or by_peer
            self._end(ev)
        if self._flushed is not None:
            self._check_flushed()

    def _on_handshake_completed(self) -> None:
        der = self._quic.peer_certificate_der()
        presented: EndpointId | None = None
        refusal: str | None = None
        if der is None:
            refusal = "peer presented no certificate"
        else:
            try:
                presented = endpoint_id_of_cert(der)
            except ValueError as exc:
                refusal = f"unusable certificate: {exc}"
        if presented is None:
            pass
        elif not self._server_side:
            if presented != self._peer:
                refusal = f"{IDENTITY_MISMATCH}: expected {self._peer}, presented {presented}"
        else:
            try:  # the application's accept policy: its failure refuses, never escapes
                refusal = self._owner._refusal(self._route, presented)
            except Exception as exc:
                log.exception("accept policy failed for %s", presented.short())
                refusal = f"accept policy failed: {exc!r}"
        if refusal is not None:
            if self._server_side and presented is not None and self._peer is None:
                self.label = self._owner.label_for(presented)
            prefix = "refused: " if self._server_side else ""
            err = PeerAuthenticationError(self.label, prefix + refusal)
            if self._server_side:
                self._owner._note_refusal(err)
            self._fail_handshake(err, AppError.REFUSED, refusal)
            return
        assert presented is not None
        self._authenticated = True
        self._quic.admit()
        if self._server_side:
            self._peer = presented
            self.label = self._owner.label_for(presented)
        self._owner._punch_towards(self)
        if not self._server_side:
            self._stream_open = True
            self._start_frames()
            self._send_ping()  # opens the stream; the server's PONG confirms it accepted us

    def _on_stream_data(self, ev: events.StreamDataReceived) -> None:
        if ev.stream_id != STREAM_ID:
            self._protocol_error(f"opened an unexpected QUIC stream ({ev.stream_id})")
            return
        if not self._authenticated or self._error is not None:
            return
        if not self._established.done():
            self._established.set_result(None)
            if self._server_side:
                self._stream_open = True
                self._start_frames()
                self._owner._on_established(self)
        if ev.data:
            self._decode(self._decoder.feed, ev.data)
        if ev.end_stream and self._error is None:
            self._finish(self._end_of_stream_error(None))
            self._close_quic(AppError.NO_ERROR, "")

    def _on_terminated(self, ev: events.ConnectionTerminated) -> None:
        self._end(ev)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._mark_terminated()

    def _end(self, ev: events.ConnectionTerminated) -> None:
        """The QUIC connection is closing: fail the frame layer with the right error."""
        if self._error is not None:
            return
        err = self._error_for(ev)
        if self._server_side and not self._established.done():
            level = logging.WARNING if isinstance(err, PeerAuthenticationError) else logging.INFO
            log.log(level, "refused incoming connection: %s", err)
        elif isinstance(err, RemoteProtocolError):
            log.warning("%s", err)
        self._finish(err)

    def _finish(self, error: BaseException) -> None:
        if self._error is None and not self._established.done():
            self._established.set_exception(error)
            self._established.exception()  # retrieved: connect() may be gone already
        super()._finish(error)

    def _error_for(self, ev: events.ConnectionTerminated) -> PeerError:
        code, reason = ev.error_code, ev.reason_phrase[:_MAX_REASON]
        detail = reason or f"code {code:#x}"
        if ev.frame_type is None:  # application close: one of our AppError codes
            if code == AppError.REFUSED:
                return PeerAuthenticationError(self.label, f"refused us: {reason}")
            if code == AppError.NO_ERROR:
                return self._end_of_stream_error(None)
            return self._end_of_stream_error(f"closed by the peer: {detail}")
        if QuicErrorCode.CRYPTO_ERROR <= code < QuicErrorCode.CRYPTO_ERROR + 256:
            return PeerAuthenticationError(self.label, f"TLS handshake failed: {detail}")
        if self._by_peer:
            return self._end_of_stream_error(f"closed by the peer: {detail}")
        if reason == "Idle timeout":
            return ConnectionBrokenError(self.label, "silent too long (QUIC idle timeout)")
        return RemoteProtocolError(self.label, f"QUIC protocol violation: {detail}")

    def _fail_handshake(self, err: PeerError, code: AppError, reason: str = "") -> None:
        self._finish(err)
        self._close_quic(code, reason or str(err))

    # ---- sending, timers -------------------------------------------------------------------

    def _after_write(self) -> None:
        if self._quic.unsent(STREAM_ID) > self._cfg.write_buffer_high:
            self._write_paused = True
        self._schedule_transmit()

    def _close_quic(self, code: AppError, reason: str) -> None:
        if not self._quic.is_closing:
            self._quic.close(error_code=code, reason_phrase=reason[:_MAX_REASON])
            route = self._route
            if isinstance(route, RelayRoute) and route.direct_addr is not None:
                # A direct path may have died unnoticed (its fallback takes path_timeout):
                # the close goes through the relay too, so the peer learns of it now.
                route.also_relay = True
            self._transmit()

    def heard_directly(self) -> None:
        """A datagram of this connection came on a direct path (not through the relay:
        a peer that fell back already says nothing of our direct path)."""
        self._heard_direct_at = self._loop.time()

    def _flush_stalled(self) -> float:
        """On a direct path, which may have died unnoticed, or one that has just fallen
        back to the relay: as long as hole punching takes to fall back (both ends: the
        peer's answers must come back that way too), longer than a close waits otherwise;
        the relay is up."""
        route = self._route
        if not isinstance(route, RelayRoute):
            return 0.0
        pc = self._owner.punch_config
        now = self._loop.time()
        if route.direct_addr is None:
            # Fell back lately: what the dead path lost is sent again through the relay,
            # and acked once the peer, which may fall back up to path_timeout later,
            # answers that way too (a close then gave up with the relay healthy: an audit).
            if now - self._fell_back_at < FLUSH_STALL + pc.path_timeout:
                log.info("%s: closing, just fell back to the relay", self.label)
                return pc.path_timeout + pc.keepalive
            return 0.0
        if now - self._heard_direct_at < FLUSH_STALL:
            return 0.0  # its datagrams still come that way: the path works, it reads nothing
        log.info("%s: closing, nothing delivered on the direct path yet", self.label)
        return pc.path_timeout + pc.keepalive

    def _schedule_transmit(self) -> None:
        if not self._transmit_soon:
            self._transmit_soon = True
            self._loop.call_soon(self._transmit)

    def path_changed(self, *, fell_back: bool = False) -> None:
        """The route now sends another way (hole punching; ``fell_back``: from a direct
        path to the relay): adapt and send promptly."""
        route = self._route
        if fell_back:
            self._fell_back_at = self._loop.time()
        name, bbr_from_rtt = self._owner.congestion_control_for(route)
        self._quic.path_changed(route.max_datagram, _now(), name, bbr_from_rtt)
        if not self._terminated.done():
            self._arm_timer()
            self._schedule_transmit()

    @property
    def rtt(self) -> float | None:
        """QUIC's smoothed round-trip time to the peer, seconds."""
        return self._quic.smoothed_rtt

    @property
    def path_rtt(self) -> float | None:
        """The current path's least round trip as QUIC measured it (from the handshake
        on; a new path starts over), else the keepalive's."""
        least = self._quic.min_rtt
        return least if least is not None else super().path_rtt

    @property
    def loss_info(self) -> LossInfo:
        """Congestion control and loss detection on the current path."""
        return self._quic.loss_info

    def _transmit(self) -> None:
        self._transmit_soon = False
        if self._terminated.done():
            return
        route = self._route
        if isinstance(route, RelayRoute) and route.direct_closed:
            # The direct path's socket closed: fall back as when hole punching declares
            # the path dead, so that QUIC builds datagrams for the relay, starts its
            # congestion control afresh, and a close waits as after a fallback.
            log.info("%s: the direct path's socket closed, back to the relay", self.label)
            route.use_relay()
            self.path_changed(fell_back=True)
        for data, addr in self._quic.datagrams_to_send(now=_now()):
            route.send(data, addr)
        self._arm_timer()
        if self._write_paused and self._quic.unsent(STREAM_ID) <= self._cfg.write_buffer_high // 4:
            self._resume_writing()

    def _arm_timer(self) -> None:
        at = self._quic.get_timer()
        if self._timer is not None:
            if at is not None and self._timer_at is not None and self._timer_at <= at:
                # Armed for earlier: keep it. Under load the deadline (loss detection,
                # ACK delay) moves later with nearly every transmit, and a cancel plus a
                # new timer each time costs more than one early wake-up, which finds
                # nothing due (handle_timer acts only on what is due) and re-arms.
                return
            self._timer.cancel()
            self._timer = None
        if at is not None:
            # call_later, not call_at: aioquic's clock is time.monotonic (see above),
            # the loop's may differ (uvloop's counts whole milliseconds).
            self._timer = self._loop.call_later(max(0.0, at - _now()), self._on_timer)
            self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        if self._terminated.done():
            return
        # get_timer() refreshes aioquic's loss-detection deadline: an ACK received in this
        # loop pass (its transmit deferred to call_soon) may have moved it, and
        # handle_timer acts on the deadline as last computed (a needless probe else).
        self._quic.get_timer()
        self._quic.handle_timer(now=_now())
        self._process_events()
        self._transmit()

    def _check_flushed(self) -> None:
        f = self._flushed
        if f is None or f.done():
            return
        if self._quic.send_acked(STREAM_ID) or self._quic.is_closing or not self._route.up:
            f.set_result(None)

    def _mark_terminated(self) -> None:
        if not self._terminated.done():
            self._terminated.set_result(None)
            self._owner._unroute(self)
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)
