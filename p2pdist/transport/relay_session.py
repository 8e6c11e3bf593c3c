"""The client end of one relay session as an asyncio protocol: bytes in place, frames out.

:class:`RelaySessionProtocol` is what :class:`~.relay_path.RelayPath` connects with, on
top of a :class:`~.securestream.SecureStream`. It is an ``asyncio.BufferedProtocol``, so
the stream decrypts straight into the :class:`~p2pdist.wire.relay.RelayFrameReader`'s
buffer and each datagram is copied once (a stream reader copied every byte four more
times on the way). It reads the relay's answer to the HTTP upgrade (and, when the answer
takes the records our request offered, moves the stream to them), then relay frames.
During the handshake the session awaits them one at a time
(:meth:`RelaySessionProtocol.next_frame`); after it, every frame goes to a handler
straight from the receive callback, with no task switch in between.

How the session ends is :attr:`RelaySessionProtocol.done`: a retry-after (the handler
saw RECONNECT), or the error that ended it (connection lost, a malformed frame, a
handler that raised).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

from ..errors import ConnectionBrokenError
from ..wire.relay import (
    RECORDS_INFO,
    RECORDS_MAX,
    UPGRADE_TOKEN,
    HttpHead,
    RelayFrame,
    RelayFrameReader,
    RelayProtocolError,
    parse_http_head,
    records_key,
)
from ..wire.websocket import (
    Opcode,
    WebSocketError,
    WebSocketReader,
    accept_for,
    client_key,
    close_frame,
    echo_code,
)
from ..wire.websocket import (
    frame as ws_frame,
)
from .aeadpipe import RecordError
from .securestream import SecureStream

__all__ = ["FrameHandler", "RelaySessionProtocol", "WebSocketTransport"]

FrameHandler = Callable[[RelayFrame], float | None]
"""Acts on one frame; returns a retry-after (seconds) to end the session, else None."""

_HEAD_READ = 4096
_WEBSOCKET_READ = 256 * 1024
_REFUSAL_TEXT = 200
"""How much of a refused upgrade's body is kept for the error (the reason is its start)."""
_CLOSE_GRACE = 2.0
"""Seconds a session we close gently may take to flush before it is aborted."""


PONG_BACKLOG = 1 << 20
"""Bytes waiting to go to the relay beyond which its PINGs (WebSocket or relay frames)
go unanswered: a relay that does not read would only pile our PONGs up."""


def may_answer_ping(writer: asyncio.WriteTransport) -> bool:
    """Whether a PING may get its PONG now (see :data:`PONG_BACKLOG`)."""
    return writer.get_write_buffer_size() <= PONG_BACKLOG


class WebSocketTransport(asyncio.Transport):
    """Writes to the relay as masked WebSocket binary frames (one per write) on the
    transport underneath; everything else is that transport's."""

    def __init__(self, inner: asyncio.Transport) -> None:
        super().__init__()
        self.inner = inner

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (any run of the relay stream) as one frame."""
        if len(data):
            self.inner.write(ws_frame(data, masked=True))

    def write_control(self, opcode: Opcode, payload: bytes | bytearray) -> None:
        """Send one control frame (a PONG, a CLOSE)."""
        self.inner.write(ws_frame(payload, opcode, masked=True))

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def get_write_buffer_size(self) -> int:
        return self.inner.get_write_buffer_size()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.inner.get_extra_info(name, default)

    def close(self) -> None:
        """Say CLOSE (1000), then close the connection underneath."""
        if not self.inner.is_closing():
            self.inner.write(close_frame(masked=True))
            self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class RelaySessionProtocol(asyncio.BufferedProtocol):
    """One TLS connection to a relay, from the client's side (see the module docstring)."""

    def __init__(self, label: str, max_body: int, *, records_secret: bytes | None = None) -> None:
        self.records_secret = records_secret
        """Our record secret, offered in the upgrade request (None: no offer)."""
        self.websocket_key: str | None = client_key()
        """The ``Sec-WebSocket-Key`` of our upgrade request (None: the session asks for
        the bare ``Upgrade: p2pdist-relay``, which relays from before WebSocket framing
        take)."""
        self._websocket: WebSocketReader | None = None
        """Set when the relay's 101 chose WebSocket framing (not records)."""
        self._ws_writer: WebSocketTransport | None = None
        self._ws_closed = False
        """Whether the relay sent CLOSE (and we echoed it): the connection then closes
        cleanly, flushing the echo."""
        self.stream: SecureStream | None = None
        """The stream underneath (set by whoever makes it), moved to records when the
        relay takes the offer."""
        self._label = label
        self._loop = asyncio.get_running_loop()
        self._reader = RelayFrameReader(max_body)
        self._scratch = bytearray(_HEAD_READ)
        self._head = bytearray()
        self._answer: HttpHead | None = None
        self._upgraded = False
        """Whether the answer was 101 (frames follow), not a refusal (its text follows)."""
        self._refusal = bytearray()
        """The start of a refusal's text (at most :data:`_REFUSAL_TEXT` bytes)."""
        self._queued: deque[RelayFrame] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._handler: FrameHandler | None = None
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[float | None] = self._loop.create_future()
        """Set once: the relay's retry-after, or the error that ended the session."""
        self.last_rx = self._loop.time()
        """Loop time at which bytes last arrived (for the silence check)."""

    # ---- for the session -----------------------------------------------------------

    async def upgrade_answer(self) -> HttpHead:
        """The relay's HTTP answer to our upgrade request."""
        while self._answer is None:
            await self._next_event()
        return self._answer

    async def next_frame(self) -> RelayFrame:
        """The next frame (before :meth:`dispatch_to` only)."""
        while not self._queued:
            await self._next_event()
        return self._queued.popleft()

    @property
    def writer(self) -> asyncio.Transport:
        """Where relay frames are written after the upgrade: the connection, or, with
        WebSocket framing, a :class:`WebSocketTransport` on it."""
        if self._ws_writer is not None:
            return self._ws_writer
        assert self.transport is not None  # connection_made ran before the upgrade
        return self.transport

    @property
    def framing(self) -> str:
        """``"websocket"`` or ``"raw"`` (after the upgrade)."""
        return "websocket" if self._websocket is not None else "raw"

    @property
    def upgraded(self) -> bool:
        """Whether the relay answered the upgrade with 101 (frames follow)."""
        return self._upgraded

    @property
    def refusal_text(self) -> str:
        """What a refusal's body said, as far as it has come (the relay's 503 says why:
        "too many connections waiting to authenticate; retry later"), on one line."""
        text = self._refusal.decode("utf-8", "replace")
        return " ".join("".join(c if c.isprintable() else " " for c in text).split())

    def close(self) -> None:
        """End the session from our side: close the connection, and since we ended it,
        :attr:`done` is cancelled (not left holding an error nobody will read)."""
        if not self.done.done():
            self.done.cancel()
        elif not self.done.cancelled():
            self.done.exception()  # read: the session had its own error to report
        self._close_gently()

    def dispatch_to(self, handler: FrameHandler) -> None:
        """From now on hand every frame to ``handler`` as it arrives (queued ones first)."""
        self._handler = handler
        queued, self._queued = list(self._queued), deque()
        try:
            self._deliver(queued)
        except Exception as exc:
            self._end(exc)

    # ---- asyncio.BufferedProtocol --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._answer is None or not self._upgraded or self._websocket is not None:
            return memoryview(self._scratch)
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_rx = self._loop.time()
        try:
            if self._answer is None:
                frames = self._take_answer(nbytes)
            elif not self._upgraded:  # the rest of a refusal's body: its start is kept
                self._keep_refusal(memoryview(self._scratch)[:nbytes])
                return
            elif self._websocket is not None:
                frames = self._unwrap(memoryview(self._scratch)[:nbytes])
            else:
                frames = self._reader.buffer_updated(nbytes)
            self._deliver(frames)
        except RelayProtocolError as exc:  # bad bytes: what came before them counts first
            try:
                self._deliver(exc.frames)  # a relay's ERROR or RECONNECT says why it ends
            except Exception as first:
                self._end(first)
            self._end(exc)
        except Exception as exc:  # a handler that ends the session
            self._end(exc)

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"connection lost: {exc}" if exc else "closed the connection"
        self._end(ConnectionBrokenError(self._label, why), close=False)

    # ---- internals -----------------------------------------------------------------

    def _keep_refusal(self, data: bytes | memoryview) -> None:
        room = _REFUSAL_TEXT - len(self._refusal)
        if room > 0:
            self._refusal += data[:room]

    def _take_answer(self, nbytes: int) -> list[RelayFrame]:
        self._head += memoryview(self._scratch)[:nbytes]
        parsed = parse_http_head(self._head)
        if parsed is None:
            return []
        self._answer, used = parsed
        rest, self._head = bytes(self._head[used:]), bytearray()
        self._wake()
        self._upgraded = self._answer.start_line[1:2] == ["101"]
        if not self._upgraded:
            self._keep_tls()
            self._keep_refusal(rest)
            return []  # a refusal's body (a 503's text) is no frames: the session reads the head
        websocket = self._answer.header("upgrade").strip().lower() == "websocket"
        if websocket and (
            self.websocket_key is None
            or self._answer.header("sec-websocket-accept") != accept_for(self.websocket_key)
        ):
            raise RelayProtocolError("the relay's Sec-WebSocket-Accept does not answer our key")
        theirs = records_key(self._answer)
        if theirs is None:
            self._keep_tls()
            if websocket:  # without records a WebSocket upgrade means WebSocket frames
                if UPGRADE_TOKEN not in self._answer.header("sec-websocket-protocol"):
                    raise RelayProtocolError("the WebSocket answer names no p2pdist-relay protocol")
                self._websocket = WebSocketReader(masked=False)
                assert self.transport is not None
                self._ws_writer = WebSocketTransport(self.transport)
                self._scratch = bytearray(_WEBSOCKET_READ)
                return self._unwrap(rest)
            return self._reader.feed(rest) if rest else []  # frames sent right behind it
        if self.records_secret is None or self.stream is None:
            raise RelayProtocolError("the relay answered with records we did not offer")
        if rest:
            raise RelayProtocolError("TLS data after the relay took our records offer")
        try:
            self.stream.start_records(
                self.records_secret,
                theirs,
                dialer=True,
                info=RECORDS_INFO,
                max_record=RECORDS_MAX,
            )
        except RecordError as exc:
            raise RelayProtocolError(f"cannot start records: {exc}") from None
        return []

    def _unwrap(self, data: bytes | memoryview) -> list[RelayFrame]:
        """Relay frames from received WebSocket frames; a PING gets its PONG, a CLOSE
        ends the session."""
        assert self._websocket is not None and self._ws_writer is not None
        broken: WebSocketError | None = None
        try:
            events = self._websocket.feed(data)
        except WebSocketError as exc:
            broken, events = exc, exc.events  # what came before the bad bytes counts first
        frames: list[RelayFrame] = []
        for event in events:
            if event.opcode is Opcode.BINARY:
                try:
                    frames += self._reader.feed(event.payload)
                except RelayProtocolError as exc:
                    exc.frames[:0] = frames
                    raise
            elif event.opcode is Opcode.PING:
                if may_answer_ping(self._ws_writer):
                    self._ws_writer.write_control(Opcode.PONG, event.payload)
            elif event.opcode is Opcode.CLOSE:
                # Echo it (then the connection closes, not aborts: see _end); what came
                # before it counts first (an ERROR or RECONNECT says why).
                self._ws_writer.write_control(Opcode.CLOSE, echo_code(event.payload))
                self._ws_closed = True
                raise RelayProtocolError("the relay closed the WebSocket", frames)
        if broken is not None:
            raise RelayProtocolError(f"bad WebSocket framing: {broken}", frames)
        return frames

    def _keep_tls(self) -> None:
        if self.stream is not None:
            self.stream.keep_tls()

    def _deliver(self, frames: list[RelayFrame]) -> None:
        handler = self._handler
        if handler is None:
            if frames:
                self._queued.extend(frames)
                self._wake()
            return
        for frame in frames:
            if self.done.done():
                return
            after = handler(frame)
            if after is not None:
                self._end(None, after)

    def _end(
        self, error: BaseException | None, retry_after: float | None = None, *, close: bool = True
    ) -> None:
        """Record how the session ended (first call wins) and close the connection."""
        if not self.done.done():
            if error is None:
                self.done.set_result(retry_after)
            else:
                self.done.set_exception(error)
        self._wake()
        if not close or self.transport is None:
            return
        if error is not None and not self._ws_closed:
            self.transport.abort()
        else:
            self._close_gently()

    def _close_gently(self) -> None:
        """Close the connection after what is queued (a WebSocket session says CLOSE
        1000 first, as RFC 6455 5.5.1 asks, unless it echoed the relay's); abort it if
        it is still open :data:`_CLOSE_GRACE` s later (a peer that stops reading must not
        hold it open for ever)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._ws_writer is not None and not self._ws_closed:
            self._ws_writer.close()
        else:
            transport.close()
        self._loop.call_later(_CLOSE_GRACE, transport.abort)

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _next_event(self) -> None:
        if self.done.done():
            self.done.result()  # raises the error that ended the session
            raise ConnectionBrokenError(self._label, "the session ended")
        self._waiter = self._loop.create_future()
        await self._waiter
