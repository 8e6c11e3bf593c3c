"""What every transport shares above its byte pipe: frames, mailbox, keepalive, close.

:class:`FramedConnection` is the frame-level half of a connection. It owns the
:class:`~p2pdist.wire.frames.FrameDecoder`, the :class:`~.mailbox.Mailbox`, the
:class:`~.keepalive.Keepalive` timer, the counters, the close callbacks and the public
send/receive API. A transport subclasses it and supplies the byte pipe through a handful
of hooks (``_write``, ``_write_frame``, ``_writable``, ``_set_reading``, ``_shutdown``,
``_drop``) and feeds received bytes to :meth:`FramedConnection._decode`.

:class:`EndpointBase` is the transport-level half: our key, the accept policy, how peers
are named, the queue of accepted connections and the set of live ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Generic, TypeVar, cast

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..tls import TlsIdentity
from ..wire.frames import (
    Frame,
    FrameDecoder,
    FrameError,
    FrameKind,
    encode_data_header,
    encode_header,
)
from .base import (
    ACCEPT_QUEUE_FULL,
    NOT_ADMITTED,
    ConnectionStats,
    TransportConfig,
    routine_refusal,
)
from .keepalive import Keepalive, KeepaliveAction
from .mailbox import Mailbox, split_channel

__all__ = ["AcceptQueue", "EndpointBase", "FramedConnection", "SendStalls"]

log = logging.getLogger(__name__)

_SLOTS_FULL_LOG_INTERVAL = 10.0
"""Seconds between two warnings about incoming connections turned away for want of a
handshake slot."""

PONG = encode_header(FrameKind.PONG)
PINGS_KEPT = 8
"""PINGs remembered for their answers' round trips (8 keepalive intervals: a PONG later
than that, queued behind bulk data on a slow link, times nothing)."""
GOODBYE = encode_header(FrameKind.GOODBYE)

FLUSH_STALL = 2.0
"""Seconds :meth:`FramedConnection.close` waits for queued bytes to leave without any
of them leaving before it gives up on them (the peer stopped reading)."""
_FLUSH_POLL = 0.05
"""Seconds between two looks at what the peer has taken while a close waits."""
CLOSE_GRACE = 1.0
"""Seconds :meth:`FramedConnection.close` waits, once the peer has all our bytes, for
it to end its side too (a p2pdist peer does so as soon as its event loop runs)."""

_T = TypeVar("_T")
C = TypeVar("C", bound="FramedConnection")


class SendStalls:
    """The connections of one endpoint whose senders wait for the byte pipe, and those
    whose reading is paused. While any sender waits, every connection reads on to
    :data:`~.mailbox.STALLED_FACTOR` times ``max_buffered`` before it pauses: two
    processes whose senders each wait for the other to read, each with reading paused
    because its mailbox filled with frames for calls still sending, would wait for good
    (many collectives in flight, an all_to_all of blocks larger than ``max_buffered``).
    For peers trusted with that memory only: a Group's members (see
    ``EndpointBase.send_stalls``)."""

    def __init__(self) -> None:
        self.senders: weakref.WeakSet[FramedConnection] = weakref.WeakSet()
        self.paused: weakref.WeakSet[FramedConnection] = weakref.WeakSet()

    def stalled(self) -> bool:
        """Whether a sender waits (the mailboxes' limit is then higher)."""
        return bool(self.senders)

    def sender_waits(self, conn: FramedConnection) -> None:
        """``conn``'s senders began to wait: paused connections read on, to the higher
        limit."""
        first = not self.senders
        self.senders.add(conn)
        if first:
            for paused in list(self.paused):
                paused._mailbox.relax()


class FramedConnection:
    """The frame-level logic of one connection to one peer (transport independent).

    Subclasses implement the hooks below; everything else (the public
    :class:`~p2pdist.transport.base.Connection` API, keepalive, GOODBYE, close
    callbacks, errors naming the peer) lives here.
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        label: str,
        peer: EndpointId | None,
        on_finish: Callable[[FramedConnection], None],
        stalls: SendStalls | None = None,
    ) -> None:
        self._cfg = config
        self._peer = peer
        self.label = label
        self._on_finish = on_finish
        self._loop = asyncio.get_running_loop()
        self._handshaking = True
        """True until frames flow (the transport's own handshake is not done)."""
        self._held_for_accept = False
        """True while the connection waits for accept(): it reads nothing (AcceptQueue)."""
        self._decoder = FrameDecoder(config.limits)
        self._stalls = stalls
        self._mailbox = Mailbox(
            config.max_buffered,
            self._pause_reading,
            self._resume_reading,
            lambda: self.label,
            poll=self._read_early if self._READS_EARLY else None,
            stalled=None if stalls is None else stalls.stalled,
        )
        self._reading_early = False
        """True while a receiver reads for itself (:meth:`_read_early`, in its own task)."""
        self._stats = ConnectionStats()
        self._keepalive: Keepalive | None = None
        self._ka_timer: asyncio.TimerHandle | None = None
        self._pings_sent: dict[int, float] = {}
        """The latest PINGs (at most :data:`PINGS_KEPT`), by number, with the loop time
        each was sent: a PONG that names one (its ``seq``) is a round-trip sample of it."""
        self._ping_number = 0
        self._pings_unanswered = 0
        """PINGs sent since the last PONG, for a PONG that names none (a peer of before
        2026-12-06): a sample only when it answers the one PING out."""
        self._write_paused = False
        self._turns: collections.deque[asyncio.Event] = collections.deque()
        """Senders waiting for room, first come first served (:meth:`_drain`)."""
        self._handed: list[asyncio.Event] = []
        """Senders that handed their frames over and wait for the pipe only."""
        self._error: BaseException | None = None
        self._interrupted: BaseException | None = None
        self._closed_locally = False
        self._close_done: asyncio.Future[None] | None = None
        """Set when :meth:`close` ends: a second caller waits for the first's close."""
        self._goodbye_received = False
        self._callbacks: list[Callable[[BaseException | None], None]] = []

    # ---- hooks for the transport ---------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Hand ``data`` (a small control frame) to the byte pipe, in order."""
        raise NotImplementedError

    def _write_frame(self, header: bytes, payload: memoryview) -> None:
        """Hand one DATA frame to the byte pipe; ``payload`` may change after return."""
        raise NotImplementedError

    def _writable(self) -> bool:
        """Whether the byte pipe still takes bytes."""
        raise NotImplementedError

    def _set_reading(self, on: bool) -> None:
        """Stop (``False``) or resume (``True``) taking bytes from the peer."""
        raise NotImplementedError

    def _peer_ended_unread(self) -> bool:
        """Whether the peer's end of the stream is known to be here, unread behind our
        paused reading (then nothing should be written: see TcpConnection's)."""
        return False

    async def _shutdown(self) -> None:
        """After GOODBYE: let queued bytes go (bounded, see :meth:`_await_flush`), then
        close the byte pipe."""
        raise NotImplementedError

    async def _await_flush(
        self, flushed: asyncio.Future[None], unsent: Callable[[], int]
    ) -> int | None:
        """Wait for ``flushed`` while the peer keeps taking our bytes. Give up once
        ``unsent()`` (bytes of ours the peer has not taken yet) stays above zero without
        shrinking for :data:`FLUSH_STALL` seconds, once it has been zero for
        :data:`CLOSE_GRACE` seconds (the peer has everything but does not answer: its
        loop is busy, or it is no p2pdist peer), or after ``idle_timeout`` in all.
        None when flushed; else the bytes left (what the peer will not get, logged)."""
        loop = self._loop
        now = loop.time()
        deadline = now + max(FLUSH_STALL, self._cfg.idle_timeout)
        left, moved = unsent(), now  # moved: when the peer last took some of our bytes
        stall, extended = FLUSH_STALL, False
        while not flushed.done():
            limit = min(moved + (stall if left else CLOSE_GRACE), deadline)
            if now >= limit and left and not extended and now < deadline:
                extended = True
                if (more := self._flush_stalled()) > 0:  # the path may be changing
                    stall, moved = more, now
                    continue
            if now >= limit:
                if left:
                    why = "read too slowly" if now >= deadline else f"read nothing for {stall:g} s"
                    log.warning(
                        "%s: closed with %d bytes undelivered (the peer %s)", self.label, left, why
                    )
                return left
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(_FLUSH_POLL, limit - now)):
                    await asyncio.shield(flushed)
            now = loop.time()
            before, left = left, unsent()
            if left < before:
                moved = now  # the peer is taking our bytes (or has just taken the last)
                stall = FLUSH_STALL
        return None

    def _drop(self) -> None:
        """Close the byte pipe at once, without flushing."""
        raise NotImplementedError

    def _flush_stalled(self) -> float:
        """A close's flush made no progress for :data:`FLUSH_STALL` seconds: how many
        seconds more it may wait for progress (once), when the way to the peer may be
        about to change; 0 to give up now. By default it cannot change."""
        return 0.0

    def _on_goodbye(self) -> None:
        """The peer said GOODBYE: it sends nothing more (frames before it stay readable)."""

    # ---- public Connection API -------------------------------------------------------

    @property
    def peer_id(self) -> EndpointId:
        """The authenticated endpoint id of the peer."""
        if self._peer is None:
            raise UsageError("connection not authenticated yet")
        return self._peer

    @property
    def closed(self) -> bool:
        """True once the connection can no longer send."""
        return self._error is not None or self._closed_locally

    @property
    def stats(self) -> ConnectionStats:
        """Counters (``dropped_stale`` included)."""
        self._stats.dropped_stale = self._mailbox.dropped
        self._stats.landed_in_place = self._decoder.landed
        self._stats.buffered = self._mailbox.buffered
        self._stats.reading_paused = self._mailbox.paused
        return self._stats

    @property
    def path_rtt(self) -> float | None:
        """The keepalive's last round trip (a transport that measures its path below
        the application says so instead: TCP, QUIC). One PING's answer can be late for
        reasons of the peer's own (a blocked event loop), so it is the last resort."""
        return self._stats.rtt

    @property
    def receive_limit(self) -> int:
        """``TransportConfig.max_buffered``: what this end buffers before it pauses."""
        return self._cfg.max_buffered

    def idle_for(self) -> float:
        """Seconds since anything arrived from the peer."""
        if self._keepalive is None:
            return 0.0
        return self._loop.time() - self._keepalive.last_rx

    @property
    def end_error(self) -> BaseException | None:
        """Why the peer's side ended the connection; None while open or closed by us."""
        return None if self._closed_locally else self._error

    def add_close_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once when the connection ends (None: closed by us)."""
        if self.closed:
            self._loop.call_soon(callback, None if self._closed_locally else self._error)
        else:
            self._callbacks.append(callback)

    async def send(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Send one message on ``channel``; waits while the byte pipe is backed up.

        The whole frame is handed to the byte pipe at once, so frames of concurrent
        senders never interleave. While the pipe is backed up (or other senders wait for
        room), it first waits its turn, first come first served: concurrent senders add
        a frame each to a backed-up pipe only as it drains, not all at once. A send
        cancelled in that wait handed over nothing.
        """
        if self._write_paused or self._turns:
            await self._drain()
        self.send_nowait(channel, payload, meta=meta, seq=seq)
        if self._write_paused:
            await self._drain(in_line=False)

    async def drain(self) -> None:
        """Wait while the byte pipe is backed up, or other senders wait for room before
        this one (return at once when neither); raises what a send's wait would (the
        connection closed or broken, an interrupt)."""
        if self._write_paused or self._turns:
            await self._drain()

    def send_nowait(
        self,
        channel: int,
        payload: bytes | bytearray | memoryview = b"",
        *,
        meta: bytes = b"",
        seq: int = 0,
    ) -> None:
        """Queue one message without waiting (for small control messages)."""
        if self._closed_locally or self._error is not None or self._handshaking:
            self._check_open()
        try:
            mv = payload if type(payload) is memoryview else memoryview(payload)
            if not mv.c_contiguous:  # checked before anything is written (or encrypted)
                raise TypeError("the buffer is not C-contiguous")
            if mv.ndim != 1 or mv.itemsize != 1:
                mv = mv.cast("B")
        except TypeError as exc:
            raise UsageError(f"payload must be a C-contiguous bytes-like object: {exc}") from None
        n = mv.nbytes
        try:
            header = encode_data_header(channel, seq, meta, n, self._cfg.limits)
        except ValueError as exc:
            raise UsageError(f"{self.label}: {exc}") from None
        self._write_frame(header, mv)
        stats = self._stats
        stats.frames_sent += 1
        stats.bytes_sent += n + len(header)
        if self._keepalive is not None:
            self._keepalive.on_send(self._loop.time())

    def recv(self, channel: int, *, timeout: float | None = None) -> Coroutine[Any, Any, Frame]:
        """The next message on ``channel`` (a coroutine, as from ``async def``: the
        mailbox's own, so that waiting for a message costs one coroutine layer less)."""
        if self._closed_locally:
            return self._closed_recv()
        return self._mailbox.get(channel, timeout)

    def recv_nowait(self, channel: int) -> Frame | None:
        """The next message on ``channel`` if it has arrived, else None (never waits)."""
        return None if self._closed_locally else self._mailbox.take(channel)

    async def _closed_recv(self) -> Frame:
        raise ConnectionClosedError(f"connection to {self.label} was closed locally")

    def expect(self, channel: int, seq: int, place: memoryview) -> None:
        """Receive message ``seq`` of ``channel`` straight into ``place`` if it has not
        begun to arrive yet (see :meth:`FrameDecoder.expect`); :meth:`recv` then returns
        a frame whose payload is ``place`` itself."""
        try:
            self._decoder.expect(channel, seq, place)
        except ValueError as exc:
            raise UsageError(f"{self.label}: {exc}") from None

    def retire(self, channel: int) -> None:
        """Drop queued and future frames of ``channel``, and the places named for it."""
        self._mailbox.retire(channel)
        self._decoder.forget(channel)

    def retire_space(self, space: int) -> None:
        """:meth:`retire` every channel of ``space``, those to come too."""
        self._mailbox.retire_space(space)
        for channel in self._decoder.named_channels():
            if split_channel(channel)[0] == space:
                self._decoder.forget(channel)

    def interrupt(self, error: BaseException) -> None:
        """Fail current and future receives and send waits with ``error``.

        The connection stays open, so small control messages can still be sent.
        """
        if self._interrupted is None:
            self._interrupted = error
        self._mailbox.fail(error)
        self._wake_drain()

    async def close(self) -> None:
        """Say goodbye and close; waits (briefly, bounded) for queued bytes to leave. A
        call while another closes returns when that close is done."""
        if self._closed_locally:
            if self._close_done is not None:
                await asyncio.shield(self._close_done)
            return
        self._closed_locally = True
        done = self._close_done = self._loop.create_future()
        ended = self._error is not None
        if not ended and not self._handshaking and self._writable():
            with contextlib.suppress(Exception):
                self._write(GOODBYE)
        self._finish(ConnectionClosedError(f"connection to {self.label} was closed locally"))
        if ended:  # the peer ended it first: the transport's close must still wait for this
            self._on_finish(self)
        try:
            await self._shutdown()
        except BaseException:
            # Cancelled (or failed) while letting queued bytes go: the connection is
            # already forgotten by its transport, so nobody else would ever drop it.
            self._drop()
            raise
        finally:
            done.set_result(None)

    def abort(self, error: BaseException) -> None:
        """Drop the connection at once, failing everyone waiting with ``error``."""
        self._finish(error)
        self._drop()

    # ---- for the transport ---------------------------------------------------------------

    def _start_frames(self) -> None:
        """The transport's handshake is done: frames flow and keepalives start."""
        self._handshaking = False
        self._keepalive = Keepalive.start(
            self._cfg.keepalive_interval, self._cfg.idle_timeout, self._loop.time()
        )
        if self._held_for_accept or self._mailbox.paused:
            self._keepalive.set_rx_paused(True, self._loop.time())
        self._arm_keepalive()

    def _read_early(self) -> None:
        """What a receiver calls before it waits (the mailbox's poll): :meth:`_read_now`,
        in the receiver's own task. An end of the connection found there is told from the
        event loop (see :meth:`_finish`)."""
        self._reading_early = True
        try:
            self._read_now()
        finally:
            self._reading_early = False

    _READS_EARLY = False
    """Whether :meth:`_read_now` can take in what the byte pipe has received and not yet
    reported (a subclass that overrides it says so; then the mailbox polls it)."""

    def _read_now(self) -> None:
        """Take in what the byte pipe has received and not yet reported."""
        raise NotImplementedError

    def _decode(self, decode: Callable[[_T], list[Frame]], arg: _T) -> None:
        """Run ``decode(arg)`` on received bytes and act on the frames or the error.

        Nothing escapes: a malformed frame (or any bug while processing) closes this
        connection with a RemoteProtocolError naming the peer.
        """
        if self._error is not None:
            return
        bad: FrameError | None = None
        try:
            try:
                frames = decode(arg)
            except FrameError as exc:
                bad, frames = exc, exc.frames
            if frames:
                self._on_frames(frames)
            elif self._keepalive is not None:
                self._keepalive.on_receive(self._loop.time())
        except Exception as exc:  # nothing may escape the receive path
            log.exception("%s: error while receiving", self.label)
            self._protocol_error(f"could not process received data: {exc!r}")
            return
        if bad is not None:
            self._protocol_error(str(bad))

    def _end_of_stream_error(self, why: str | None) -> PeerError:
        """The error for the peer's byte stream ending (``why``: None for a clean end)."""
        if self._goodbye_received:
            # The peer said goodbye: it left on purpose, even if its socket then ended
            # with a reset (it closed with our last bytes still unread in its kernel).
            return ConnectionBrokenError(self.label, "closed its connection (left)", graceful=True)
        if self._mid_frame() and why is None:
            # Not a protocol violation: a p2pdist peer ends so when it crashed mid-send
            # (its kernel sends what it had, then FIN) or gave up sending to us.
            return ConnectionBrokenError(
                self.label, "connection ended in the middle of a frame, without a goodbye"
            )
        return ConnectionBrokenError(self.label, f"connection lost{f': {why}' if why else ''}")

    def _mid_frame(self) -> bool:
        """Whether the peer's stream ended inside a frame (part of it is here)."""
        return self._decoder.mid_frame

    def _resume_writing(self) -> None:
        """The byte pipe drained below its low-water mark: let senders go on."""
        self._write_paused = False
        self._wake_drain()

    def _finish(self, error: BaseException) -> None:
        """Record the end of the connection once and tell everyone waiting."""
        if self._error is not None:
            return
        self._error = error
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        if self._reading_early:
            # Found by a receiver reading for itself, inside its task: tell everyone from
            # the loop, as the loop's own read would have, so that what the close
            # callbacks do (a group reads the notices that came just before the end, and
            # cancels the calls they fail) happens outside that task, before it resumes.
            self._loop.call_soon(self._tell_finished, error)
            return
        self._tell_finished(error)

    def _tell_finished(self, error: BaseException) -> None:
        """Wake receivers and senders with ``error`` and run the close callbacks."""
        self._mailbox.fail(error)
        self._wake_drain()
        report = None if self._closed_locally else error
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(report)
            except Exception:
                log.exception("%s: close callback failed", self.label)
        self._on_finish(self)

    def _protocol_error(self, message: str) -> None:
        err = RemoteProtocolError(self.label, message)
        log.warning("%s", err)
        self.abort(err)

    def _send_ping(self) -> None:
        """Send a keepalive PING (also measures the round-trip time)."""
        now = self._loop.time()
        self._ping_number += 1
        self._write(encode_header(FrameKind.PING, seq=self._ping_number))
        if self._keepalive is not None:
            self._keepalive.on_send(now)
        sent = self._pings_sent
        sent[self._ping_number] = now
        if len(sent) > PINGS_KEPT:
            del sent[next(iter(sent))]
        self._pings_unanswered += 1

    # ---- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed_locally:
            raise ConnectionClosedError(f"connection to {self.label} was closed locally")
        if self._error is not None:
            raise self._error.with_traceback(None)
        if self._handshaking:
            raise UsageError(f"connection to {self.label} is still handshaking")

    def _wake_drain(self) -> None:
        """Writing resumed (the first sender in line goes on, and every sender that only
        waits for the pipe to drain), or the connection ended or was interrupted (every
        sender hears of it)."""
        for waiter in self._handed:  # first: they go on before the line refills the pipe
            waiter.set()
        if self._write_paused is False and self._error is None and self._interrupted is None:
            if self._turns:
                self._turns[0].set()
            return
        for turn in self._turns:
            turn.set()

    async def _drain(self, *, in_line: bool = True) -> None:
        """Wait until writing is not paused and, ``in_line`` (a sender about to hand
        over a frame), every sender that came before has gone on: each hands over its
        frame in its turn, so the pipe takes one frame more at a time, not one per
        sender. A sender that has handed its frame over waits only for the pipe."""
        stalls = self._stalls
        turn = asyncio.Event()  # set when this sender may look again
        turns = self._turns
        (turns.append if in_line else self._handed.append)(turn)
        if len(turns) + len(self._handed) == 1 and stalls is not None:
            stalls.sender_waits(self)  # the endpoint's connections read on, to a higher limit
        try:
            while self._write_paused or (in_line and turns[0] is not turn):
                self._check_open()
                if self._interrupted is not None:
                    raise self._interrupted.with_traceback(None)
                await turn.wait()
                turn.clear()
            self._check_open()
        finally:
            if not in_line:
                self._handed.remove(turn)
            else:
                first = turns[0] is turn
                turns.remove(turn)
                if first and turns and not self._write_paused:
                    # The next in line goes on once this sender has handed over its
                    # frame (in this same step): it finds the pipe backed up again, or not.
                    turns[0].set()
            if not (turns or self._handed) and stalls is not None:
                stalls.senders.discard(self)

    def _pause_reading(self) -> None:
        if self._stalls is not None:
            self._stalls.paused.add(self)
        if not self._held_for_accept:  # (else paused already)
            self._stop_reading(True)

    def _resume_reading(self) -> None:
        if self._stalls is not None:
            self._stalls.paused.discard(self)
        if not self._held_for_accept:  # (else it reads once accepted)
            self._stop_reading(False)

    def _hold_for_accept(self, on: bool) -> None:
        """(AcceptQueue) read nothing while waiting for accept() (``on``); read again,
        unless the mailbox holds reading paused, once handed out."""
        if on != self._held_for_accept:
            self._held_for_accept = on
            if not self._mailbox.paused:
                self._stop_reading(on)

    def _stop_reading(self, stop: bool) -> None:
        if self._keepalive is not None:  # the peer's silence is then our own doing
            self._keepalive.set_rx_paused(stop, self._loop.time())
        self._set_reading(not stop)

    def _on_frames(self, frames: list[Frame]) -> None:
        now = self._loop.time()
        if self._keepalive is not None:
            self._keepalive.on_receive(now)
        for f in frames:
            self._stats.frames_received += 1
            self._stats.bytes_received += f.nbytes
            if f.kind is FrameKind.DATA:
                self._mailbox.deliver(f)
            elif f.kind is FrameKind.PING:
                # Not while our writes back up: the peer is not reading them (a PONG
                # would reach it no sooner), and a peer that pings without reading
                # must not grow our write buffer without bound.
                if self._writable() and not self._write_paused:
                    # The PONG names the PING it answers (its seq), for the round trip.
                    self._write(encode_header(FrameKind.PONG, seq=f.seq) if f.seq else PONG)
            elif f.kind is FrameKind.PONG:
                self._on_pong(f.seq, now)
            elif f.kind is FrameKind.GOODBYE:
                self._goodbye_received = True
                self._on_goodbye()
                return  # nothing follows a GOODBYE

    def _on_pong(self, number: int, now: float) -> None:
        """A PONG answering PING ``number`` (0: a peer that does not say which) came in."""
        sent = self._pings_sent
        if number:
            at = sent.pop(number, None)
            if at is not None:  # (one of the latest: a late answer still times its PING)
                self._stats.rtt = now - at
        elif self._pings_unanswered == 1 and sent:
            self._stats.rtt = now - sent[next(reversed(sent))]
        self._pings_unanswered = 0

    def _arm_keepalive(self) -> None:
        if self._keepalive is None or self._error is not None:
            return
        self._ka_timer = self._loop.call_at(
            self._keepalive.next_deadline() + 0.001, self._on_keepalive_timer
        )

    def _on_keepalive_timer(self) -> None:
        ka = self._keepalive
        if ka is None or self.closed:
            return
        now = self._loop.time()
        action = ka.poll(now)
        if action is KeepaliveAction.DEAD:
            self.abort(
                ConnectionBrokenError(
                    self.label, f"silent for {now - ka.last_rx:.1f} s (keepalive timeout)"
                )
            )
            return
        # Not while writing is paused: the bytes already queued keep the peer's timer
        # fed, and a PING would only grow a buffer the peer is not taking.
        if (
            action is KeepaliveAction.PING
            and self._writable()
            and not self._write_paused
            and not self._peer_ended_unread()
        ):
            self._send_ping()
        self._arm_keepalive()


class AcceptQueue(Generic[C]):
    """Authenticated incoming connections waiting for ``accept()``; closable. A waiting
    connection reads nothing from its peer (what the peer sends stays in the kernel, and
    TCP's or QUIC's flow control holds the peer back) until it is handed out."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[C | None] = asyncio.Queue()  # None: closed
        self._closed = False
        """Whether :meth:`close` was called (the queue then ends in one None)."""

    def __len__(self) -> int:
        """Connections waiting now."""
        return self._queue.qsize() - self._closed

    def put(self, conn: C) -> None:
        """Hand ``conn`` to the next ``get``."""
        conn._hold_for_accept(True)
        self._queue.put_nowait(conn)

    def _handed_out(self, conn: C) -> C:
        conn._hold_for_accept(False)
        return conn

    async def get(self, timeout: float | None) -> C:
        """The next connection; ConnectionClosedError once :meth:`close` was called."""
        try:
            async with asyncio.timeout(timeout):
                conn = await self._queue.get()
        except TimeoutError:
            raise P2PTimeoutError(f"no incoming connection within {timeout} s") from None
        if conn is None:
            self._queue.put_nowait(None)  # wake the next waiter too
            raise ConnectionClosedError("transport is closed")
        return self._handed_out(conn)

    def take_waiting(self) -> list[C]:
        """The connections waiting now, taken without waiting (the queue stays open)."""
        taken: list[C] = []
        while not self._queue.empty():
            c = self._queue.get_nowait()
            if c is None:  # closed: leave the mark for the next waiter
                self._queue.put_nowait(None)
                break
            taken.append(self._handed_out(c))
        return taken

    def close(self) -> list[C]:
        """Wake every waiter with ConnectionClosedError; returns the unclaimed connections."""
        left: list[C] = []
        while not self._queue.empty():
            c = self._queue.get_nowait()
            if c is not None:
                c._hold_for_accept(False)  # its close reads on until the peer's end
                left.append(c)
        self._closed = True
        self._queue.put_nowait(None)
        return left


class EndpointBase(Generic[C]):
    """Key, configuration, accept policy, peer names and connection bookkeeping."""

    def __init__(
        self,
        key: SecretKey,
        config: TransportConfig | None,
        accept_from: Callable[[EndpointId], bool | str] | None,
        label_for: Callable[[EndpointId], str] | None,
    ) -> None:
        self.key = key
        self.config = config or TransportConfig()
        self._accept_from = accept_from
        self._label_for = label_for
        self._tls: TlsIdentity | None = None
        self._accepted: AcceptQueue[C] = AcceptQueue()
        self._connections: set[C] = set()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._user_closes: set[asyncio.Future[None]] = set()
        """When the closes of connections their users closed end (see :meth:`_forget`)."""
        self.send_stalls: SendStalls | None = None
        """Set before the first connection (a Group sets one for its transport): while a
        sender on one of this endpoint's connections waits, all of them read on to a
        higher limit (see :class:`SendStalls`). None: each connection pauses on its
        own, whatever its senders do (a coordinator's clients, who need not be trusted
        with the memory)."""
        self.refused_incoming = 0
        """Incoming connections refused in their handshake (not allowed here, another id
        asked for, a failed proof)."""
        self.last_refusal: str | None = None
        """Why the last of them was refused, naming where it came from."""
        self.refused_handshakes = 0
        """Incoming connections turned away at once because ``max_pending_handshakes``
        handshakes were already in progress (TCP: ``TransportConfig``; QUIC:
        ``QuicConfig``)."""
        self._slots_full_logged_at: float | None = None

    def _note_refusal(self, err: PeerAuthenticationError) -> None:
        """Log an incoming connection refused in its handshake (at info when routine: the
        accept policy's refusals, a full accept queue); count it and remember why, unless
        it was the queue (no refusal of who the dialer is)."""
        why = str(err)
        log.log(
            logging.INFO if routine_refusal(why) else logging.WARNING,
            "refused incoming connection: %s",
            err,
        )
        if ACCEPT_QUEUE_FULL not in why:
            self.refused_incoming += 1
            self.last_refusal = why

    def _note_handshake_slots_full(self, in_progress: int, what: str) -> None:
        """Count an incoming connection turned away because ``in_progress`` handshakes
        fill every slot (``max_pending_handshakes``); ``what`` says what became of it.
        Warns at most once per :data:`_SLOTS_FULL_LOG_INTERVAL` seconds."""
        self.refused_handshakes += 1
        now = asyncio.get_running_loop().time()
        last = self._slots_full_logged_at
        if last is None or now - last >= _SLOTS_FULL_LOG_INTERVAL:
            self._slots_full_logged_at = now
            log.warning(
                "%d incoming handshakes already in progress (max_pending_handshakes): "
                "%s (%d so far)",
                in_progress,
                what,
                self.refused_handshakes,
            )

    @property
    def endpoint_id(self) -> EndpointId:
        """Our endpoint id."""
        return self.key.endpoint_id

    @property
    def tls_identity(self) -> TlsIdentity:
        """Our certificate and SSL contexts (made on first use)."""
        if self._tls is None:
            self._tls = TlsIdentity(self.key)
        return self._tls

    def label_for(self, peer: EndpointId) -> str:
        """How to name ``peer`` in errors. The application's ``label_for`` runs inside
        the receive path, so if it raises, the short id is used (and the error logged)."""
        fallback = f"peer {peer.short()}"
        if self._label_for is None:
            return fallback
        try:
            return self._label_for(peer)
        except Exception:
            log.exception("label_for failed for %s", peer.short())
            return fallback

    def accepts(self, peer: EndpointId) -> bool:
        """Whether ``peer`` may connect to us."""
        return self.refusal_for(peer) is None

    def refusal_for(self, peer: EndpointId) -> str | None:
        """None when ``accept_from`` admits ``peer`` and the accept queue has room, else
        the reason the dialer is given: ``endpoint ID is not allowed to connect here``,
        followed by the reason ``accept_from`` returned when it returned a string instead
        of False; or :data:`ACCEPT_QUEUE_FULL` (``max_accept_queue`` connections wait for
        accept() here: a dialer may try again, ``dial_with_retry`` does)."""
        verdict = True if self._accept_from is None else self._accept_from(peer)
        if verdict is True or (verdict and not isinstance(verdict, str)):
            return self._accept_queue_refusal()
        refusal = f"endpoint {peer} {NOT_ADMITTED}"
        return f"{refusal}: {verdict}" if isinstance(verdict, str) and verdict else refusal

    def _accept_queue_refusal(self) -> str | None:
        most = self.config.max_accept_queue
        if len(self._accepted) < most:
            return None
        return f"{ACCEPT_QUEUE_FULL}: {most} connections (max_accept_queue) wait for accept()"

    async def accept(self, *, timeout: float | None = None) -> C:
        """The next authenticated incoming connection."""
        self._check_not_closed()
        return await self._accepted.get(timeout)

    def take_accepted(self) -> list[C]:
        """The authenticated incoming connections that wait for :meth:`accept` now, taken
        without waiting (the caller answers them; :meth:`close` still closes them)."""
        return self._accepted.take_waiting()

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ConnectionClosedError("transport is closed")

    def _check_not_self(self, peer: EndpointId, name: str) -> None:
        """Refuse to dial our own endpoint id: through a relay, or at our own address,
        the handshake would succeed against ourselves and every wait after it hang."""
        if peer == self.endpoint_id:
            raise UsageError(
                f"{name}: that is this transport's own endpoint id (the same key on both ends?)"
            )

    async def close(self) -> None:
        """Stop accepting and close every connection and socket (bounded). A call while
        another closes returns when that close is done."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._shutdown())
        # Shielded: a cancelled close() still finishes closing in the background.
        await asyncio.shield(self._close_task)

    async def _shutdown(self) -> None:
        """The transport-specific part of :meth:`close`."""
        await self._close_all()

    def _forget(self, conn: FramedConnection) -> None:
        self._connections.discard(cast(C, conn))
        closing = conn._close_done
        if closing is not None and not closing.done():
            # Its own close() lets queued bytes go: ours waits for that too (a QUIC
            # connection's datagrams leave by this transport's socket).
            self._user_closes.add(closing)
            closing.add_done_callback(self._user_closes.discard)

    async def _close_all(self, extra: Iterable[C] = ()) -> None:
        """Close every connection, accepted or not, and wait for the closes their users
        began (all bounded); wake ``accept()``."""
        conns = set(self._connections) | set(self._accepted.close()) | set(extra)
        waits = [*(c.close() for c in conns), *(asyncio.shield(f) for f in self._user_closes)]
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)
