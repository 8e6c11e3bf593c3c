"""Point-to-point array messages: one array as a few frames on its own channel.

Frame 0's meta is msgpack ``[array header, frame count]``; the payloads are consecutive
pieces of the array's bytes, at most :data:`CHUNK` each. A piece is handed to the
connection only once the connection keeps up, and a send returns once its last piece is
handed over, so a send that ends early (a cancellation, its timeout) has not delivered
its message: it sends one frame more, with an empty payload and meta :data:`ABANDONED`
and the seq of the first piece that did not go out. At seq 0 the message is withdrawn
(the receiver skips it, as if it had never been sent: a retry is the next message);
later, the receiver's recv fails at once instead of waiting out its timeout for the
rest. The receiver checks the sender's
dtype and shape against what it expects before it allocates anything; byte order is not
part of the check (arrays travel little-endian, and a big-endian ``out`` is filled with the
same values, its bytes swapped).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ..errors import MismatchError, P2PError, PeerError, PeerTimeoutError, RemoteProtocolError
from ..transport.base import Connection
from ..wire.arrays import ArrayHeader, ArrayHeaderError, check_dtype
from ..wire.frames import Frame
from .buffers import mismatch
from .link import PIECE_BYTES

__all__ = ["ABANDONED", "CHUNK", "Withdrawn", "recv_array", "send_array"]

CHUNK = PIECE_BYTES
ABANDONED = b"abandoned"
"""Meta of the frame that ends a message whose sender stopped before its piece ``seq``
(frames after the first have an empty meta otherwise)."""


class Withdrawn(Exception):
    """The message on this channel was withdrawn before any of it went out: the recv
    that took the channel takes the next one instead."""


async def send_array(
    conn: Connection, channel: int, arr: np.ndarray, header: ArrayHeader, seconds: float
) -> None:
    """Send ``arr`` (C-contiguous; ``header`` is ``ArrayHeader.of(arr)``) on ``channel``;
    bounded by ``seconds``. Returns once the whole message is handed to the connection
    (which delivers it unless it breaks); one that raises delivered no message (see the
    module's docstring)."""
    data = arr.reshape(-1).data.cast("B") if arr.size else memoryview(b"")
    pieces = [data[i : i + CHUNK] for i in range(0, data.nbytes, CHUNK)] or [data]
    meta = bytes(msgpack.packb([header.to_wire(), len(pieces)], use_bin_type=True))
    handed = 0
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            for seq, piece in enumerate(pieces):
                # Wait first, then hand over without waiting: a piece handed over goes
                # out, whatever ends a wait, so no wait may follow the last one.
                await conn.drain()
                conn.send_nowait(channel, piece, meta=meta if seq == 0 else b"", seq=seq)
                handed = seq + 1
    except (TimeoutError, asyncio.CancelledError) as exc:  # only drain() waits: handed < n
        with contextlib.suppress(P2PError):
            conn.send_nowait(channel, meta=ABANDONED, seq=handed)
        # Not an interrupt's (a broken group's PeerTimeoutError is a TimeoutError too).
        if isinstance(exc, TimeoutError) and deadline.expired():
            n = len(pieces)
            what = "nothing went out" if not handed else f"{handed} of its {n} pieces went out"
            raise PeerTimeoutError(
                conn.label,
                f"send of {header.describe()} did not go out within {seconds:g} s, the "
                f"peer or the link not keeping up ({what}; the message is dropped, so "
                "sending it again is safe)",
            ) from None
        raise


async def recv_array(
    conn: Connection,
    channel: int,
    want: tuple[np.dtype[Any] | None, tuple[int, ...] | None],
    out: np.ndarray | None,
    seconds: float,
    max_bytes: int,
    give_back: Callable[[], None],
    *,
    deadline: float,
) -> np.ndarray:
    """Receive the array sent on ``channel``; the channel is retired afterwards, unless
    the call ends (a timeout, a cancellation) before any of the message came: then it
    stays open, so the message is kept when it comes, and ``give_back()`` is called (the
    caller's next recv from this peer takes the channel again). A message cut short by a
    timeout is dropped, and the error says so; a withdrawn one raises :class:`Withdrawn`.

    ``want`` comes from :func:`~p2pdist.group.buffers.expectation` (dtype in wire form).
    The wait ends at the loop time ``deadline`` (one recv skips withdrawn messages within
    it); ``seconds`` is the recv's timeout, as its error says it.
    """
    want_dtype, want_shape = want
    first: Frame | None = None
    pieces = (0, 0)  # pieces taken, pieces in the message
    bound = asyncio.timeout_at(deadline)
    try:
        async with bound:
            first = await conn.recv(channel)
            if first.meta == ABANDONED and first.seq == 0:
                raise Withdrawn
            header, count = _parse_meta(conn, first.meta)
            if count != max(1, -(-header.nbytes // CHUNK)):
                raise RemoteProtocolError(conn.label, "array chunk count does not match")
            if header.nbytes > max_bytes and out is None:
                raise MismatchError(
                    conn.label,
                    f"sent {header.describe()} ({header.nbytes} bytes), over this group's "
                    f"max_message_bytes={max_bytes}",
                )
            wrong = mismatch(check_dtype(header.dtype), header.shape, want_dtype, want_shape)
            if wrong:
                raise MismatchError(
                    conn.label, f"sent {header.describe()} but recv expected {wrong}"
                )
            # One frame and no ``out``: the frame's payload is this message's own buffer,
            # and a view of it is the result (no copy); otherwise the result is filled.
            as_view = out is None and count == 1
            if out is not None:
                result = out
            else:  # the view case checks the frames without filling anything
                result = np.empty(0 if as_view else header.shape, header.dtype)
            flat = result.reshape(-1).view(np.uint8) if result.size else None
            filled, frame = 0, first
            for seq in range(count):
                pieces = (seq, count)
                if seq:
                    frame = await conn.recv(channel)
                    if frame.meta == ABANDONED and frame.seq == seq:
                        raise PeerError(
                            conn.label,
                            f"stopped sending {header.describe()} after {seq} of its "
                            f"{count} pieces (its send was cancelled or timed out); "
                            "the message is dropped",
                        )
                n = frame.payload.nbytes
                if frame.seq != seq or filled + n > header.nbytes:
                    raise RemoteProtocolError(conn.label, "malformed array message")
                if n and flat is not None:
                    flat[filled : filled + n] = np.frombuffer(frame.payload, np.uint8)
                filled += n
            if filled != header.nbytes:
                raise RemoteProtocolError(conn.label, "array message shorter than its header")
            if out is not None and out.dtype.isnative != header.dtype.isnative:
                out.byteswap(inplace=True)  # a big-endian out: the same values, its order
            return header.view(first.payload) if as_view else result
    except TimeoutError:
        if not bound.expired():
            raise  # an interrupt's (a broken group's PeerTimeoutError), not ours
        what = "no array"
        if first is not None:
            what = f"{pieces[0]} of the {pieces[1]} pieces of an array (it is dropped)"
        raise PeerTimeoutError(conn.label, f"recv got {what} within {seconds:g} s") from None
    finally:
        if first is None:
            give_back()
        else:
            conn.retire(channel)


def _parse_meta(conn: Connection, meta: bytes) -> tuple[ArrayHeader, int]:
    try:
        header_wire, count = msgpack.unpackb(meta, raw=False)
        header = ArrayHeader.from_wire(header_wire)
        if not isinstance(count, int) or not 1 <= count <= (1 << 20):
            raise ArrayHeaderError("bad chunk count")
    except (ArrayHeaderError, ValueError, TypeError) as exc:
        raise RemoteProtocolError(conn.label, f"malformed array header: {exc}") from None
    except Exception as exc:  # msgpack's own exception types
        raise RemoteProtocolError(conn.label, f"undecodable array header: {exc}") from None
    return header, count
