"""One collective's view of the group: its channel, sequence numbers and call check.

Every message of a collective travels on that collective's own channel with a per-peer
sequence number, so a late or duplicate message can never be consumed by another
collective. The first message to each peer carries a descriptor of the call (collective,
op, dtype, shape, root); the receiver compares it with its own and raises
:class:`~p2pdist.errors.MismatchError` naming the peer when ranks called different things.

A message larger than :data:`PIECE_BYTES` (a gather's or an all-to-all's block can be
any size; a frame can carry at most the transport's ``max_payload``) travels as an 8-byte
length, then pieces of at most :data:`PIECE_BYTES`, each a frame with its own sequence
number; the receiver checks the length against the size it expects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgpack
import numpy as np

from ..errors import MismatchError, RemoteProtocolError
from ..transport.base import Connection

__all__ = ["PIECE_BYTES", "THIS_RANK", "CollectiveLink", "as_told_to_others", "describe_call"]

THIS_RANK = "this rank"
"""How a mismatch names the rank that raises it (an abort notice that relays the text to
the other ranks names the rank instead: :func:`as_told_to_others`)."""
PIECE_BYTES = 64 << 20
"""Largest frame payload a group sends (point to point and collectives alike); longer
messages go in pieces. A group's transport must accept frames this large."""


def describe_call(
    name: str, op: str, dtype: str, shape: Sequence[int], root: int | None = None
) -> bytes:
    """The descriptor ranks compare to check that they called the same collective.

    Encoded once per distinct call and remembered (a loop repeats the same few calls)."""
    return _descriptor(name, op, dtype, tuple(shape), root)


@functools.lru_cache(maxsize=4096)
def _descriptor(name: str, op: str, dtype: str, shape: tuple[int, ...], root: int | None) -> bytes:
    return bytes(msgpack.packb([name, op, dtype, list(shape), root], use_bin_type=True))


def as_told_to_others(text: str, label: str) -> str:
    """``text`` (an error raised on this rank) as another rank must read it: "this rank"
    there is ``label``, the rank that raised it."""
    return text.replace(f"but {THIS_RANK} called", f"but {label} called")


def _explain(desc: bytes) -> str:
    try:
        name, op, dtype, shape, root = msgpack.unpackb(desc, raw=False)
    except Exception:
        return "an undecodable call"
    try:
        dtype = np.dtype(dtype).name if dtype else ""
    except TypeError:
        dtype = repr(dtype)
    if name == "split":  # its descriptor's dtype and shape are internal
        parts = ["color, key"]
    elif dtype or shape:  # a -1 dimension (all_to_all_v's rows) differs between ranks
        dims = ", ".join("*" if d == -1 else str(d) for d in shape)
        parts = [f"{dtype}[{dims}]"]
    else:  # barrier: no array
        parts = []
    if op:
        parts.append(f"op={op!r}")
    if root is not None:
        parts.append(f"root={root}")
    return f"{name}({', '.join(parts)})"


class CollectiveLink:
    """Implements :class:`~p2pdist.group.linkops.Link` for one collective call."""

    __slots__ = (
        "_conn",
        "_long_places",
        "_rank",
        "_received",
        "_receiving",
        "_sent",
        "_size",
        "channel",
        "descriptor",
        "made",
        "waiting_on",
    )

    def __init__(
        self,
        rank: int,
        size: int,
        channel: int,
        descriptor: bytes,
        connection: Callable[[int], Connection],
        made: int,
    ) -> None:
        self._rank, self._size = rank, size
        self.channel = channel
        self.descriptor = descriptor
        self.made = made
        """The call's place in the order its group and their sub-groups' calls were made."""
        self._conn = connection
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._long_places: dict[tuple[int, int], tuple[memoryview, list[memoryview]]] = {}
        """(peer, seq of its length) -> the place of a long message and its pieces."""
        self.waiting_on: int | None = None
        """The rank this collective is blocked on right now (for timeout messages)."""
        self._receiving: int | None = None
        """The rank a receive of this collective waits for right now (not a send)."""

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    # send and recv return the one frame's coroutine for a message that fits a frame (a
    # coroutine layer less on the latency path), as an ``async def`` would be awaited.

    def send(self, peer: int, payload: memoryview) -> Coroutine[Any, Any, None]:
        """Send the next message of this collective to ``peer`` (bytes, in pieces if long)."""
        if payload.nbytes <= PIECE_BYTES:
            return self._send_frame(peer, payload)
        return self._send_long(peer, payload)

    async def _send_long(self, peer: int, payload: memoryview) -> None:
        n = payload.nbytes
        await self._send_frame(peer, memoryview(n.to_bytes(8, "little")))
        for i in range(0, n, PIECE_BYTES):
            await self._send_frame(peer, payload[i : i + PIECE_BYTES])

    async def _send_frame(self, peer: int, payload: memoryview) -> None:
        seq = self._sent.get(peer, 0)
        self._sent[peer] = seq + 1
        meta = self.descriptor if seq == 0 else b""
        self.waiting_on = peer
        await self._conn(peer).send(self.channel, payload, meta=meta, seq=seq)
        self.waiting_on = None

    def recv(self, peer: int, nbytes: int) -> Coroutine[Any, Any, memoryview]:
        """The next message of this collective from ``peer``; checks order, call and size."""
        if nbytes <= PIECE_BYTES:
            return self._recv_frame(peer, nbytes)
        return self._recv_long(peer, nbytes)

    async def _recv_long(self, peer: int, nbytes: int) -> memoryview:
        first = self._received.get(peer, 0)
        announced = int.from_bytes(await self._recv_frame(peer, 8), "little")
        if announced != nbytes:
            raise MismatchError(
                self.label(peer),
                f"sent {announced} bytes where {nbytes} were expected in {self.explain()}",
            )
        place, pieces = self._long_places.pop((peer, first), (None, []))
        if place is None:
            place = memoryview(bytearray(nbytes))
            pieces = _pieces(place)
        for piece in pieces:
            data = await self._recv_frame(peer, piece.nbytes)
            if data is not piece:  # it came before its place was named
                piece[:] = data
        return place

    async def _recv_frame(self, peer: int, nbytes: int) -> memoryview:
        conn = self._conn(peer)
        seq = self._received.get(peer, 0)
        self._received[peer] = seq + 1
        self.waiting_on = self._receiving = peer
        frame = await conn.recv(self.channel)
        self.waiting_on = self._receiving = None
        if frame.seq != seq:
            raise RemoteProtocolError(
                conn.label, f"message {frame.seq} arrived where {seq} was due (channel reuse?)"
            )
        if seq == 0 and frame.meta != self.descriptor:
            raise MismatchError(
                conn.label,
                f"called {_explain(frame.meta)} but {THIS_RANK} called {_explain(self.descriptor)}",
            )
        if frame.payload.nbytes != nbytes:
            raise MismatchError(
                conn.label,
                f"sent {frame.payload.nbytes} bytes where {nbytes} were expected "
                f"in {_explain(self.descriptor)}",
            )
        return frame.payload

    def round_trip(self, peer: int) -> float:
        """The path's round trip to ``peer`` as its transport measures it
        (``Connection.path_rtt``), seconds; 0 until there is one."""
        return float(self._conn(peer).path_rtt or 0.0)

    def receive_limit(self, peer: int) -> int:
        """What the connection to ``peer`` buffers before it stops reading (ranks share
        their TransportConfig, so the peer's end holds as much)."""
        return self._conn(peer).receive_limit

    def expect(self, peer: int, places: Sequence[memoryview]) -> None:
        """Receive the next ``len(places)`` messages from ``peer`` straight into
        ``places``, in order (each one that has not begun to arrive yet and has the
        place's size): :meth:`recv` returns the place itself for those. Empty places
        are skipped; the places are let go when the call ends (``retire``)."""
        conn = self._conn(peer)
        seq = self._received.get(peer, 0)
        for place in places:
            if place.nbytes > PIECE_BYTES:  # its length first, then its pieces
                pieces = _pieces(place)
                self._long_places[peer, seq] = (place, pieces)
                for i, piece in enumerate(pieces, 1):
                    conn.expect(self.channel, seq + i, piece)
                seq += 1 + len(pieces)
                continue
            if place.nbytes:
                conn.expect(self.channel, seq, place)
            seq += 1

    def heard_from(self, peer: int) -> bool:
        """Whether a message of this call came from ``peer`` (so it did start the call):
        the receives counted from it, less the one still waiting, if any."""
        waiting = 1 if self._receiving == peer else 0
        return self._received.get(peer, 0) - waiting > 0

    def label(self, peer: int) -> str:
        """How errors name ``peer``."""
        return self._conn(peer).label

    def explain(self) -> str:
        """This call in words, e.g. ``all_reduce(float32[1024], op='sum')``."""
        return _explain(self.descriptor)


def _pieces(place: memoryview) -> list[memoryview]:
    """``place`` (bytes) cut into the pieces a long message travels in."""
    return [place[i : i + PIECE_BYTES] for i in range(0, place.nbytes, PIECE_BYTES)]
