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
    HttpHead,
    RelayFrame,
    RelayFrameReader,
    RelayProtocolError,
    parse_http_head,
    records_key,
)
from .aeadpipe import RecordError
from .securestream import SecureStream

__all__ = ["FrameHandler", "RelaySessionProtocol"]

FrameHandler = Callable[[RelayFrame], float | None]
"""Acts on one frame; returns a retry-after (seconds) to end the session, else None."""

_HEAD_READ = 4096


class RelaySessionProtocol(asyncio.BufferedProtocol):
    """One TLS connection to a relay, from the client's side (see the module docstring)."""

    def __init__(self, label: str, max_body: int, *, records_secret: bytes | None = None) -> None:
        self.records_secret = records_secret
        """Our record secret, offered in the upgrade request (None: no offer)."""
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
    def upgraded(self) -> bool:
        """Whether the relay answered the upgrade with 101 (frames follow)."""
        return self._upgraded

    def close(self) -> None:
        """End the session from our side: close the connection, and since we ended it,
        :attr:`done` is cancelled (not left holding an error nobody will read)."""
        if not self.done.done():
            self.done.cancel()
        elif not self.done.cancelled():
            self.done.exception()  # read: the session had its own error to report
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

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
        if self._answer is None or not self._upgraded:
            return memoryview(self._scratch)
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_rx = self._loop.time()
        try:
            if self._answer is None:
                frames = self._take_answer(nbytes)
            elif not self._upgraded:
                return  # the rest of a refusal's body: nothing for us
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
            return []  # a refusal's body (a 503's text) is no frames: the session reads the head
        theirs = records_key(self._answer)
        if theirs is None:
            self._keep_tls()
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
        if close and self.transport is not None and not self.transport.is_closing():
            if error is None:
                self.transport.close()
            else:
                self.transport.abort()

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
