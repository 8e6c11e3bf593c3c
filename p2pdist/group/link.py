"""One collective's view of the group: its channel, sequence numbers and call check.

Every message of a collective travels on that collective's own channel with a per-peer
sequence number, so a late or duplicate message can never be consumed by another
collective. The first message to each peer carries a descriptor of the call (collective,
op, dtype, shape, root); the receiver compares it with its own and raises
:class:`~p2pdist.errors.MismatchError` naming the peer when ranks called different things.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import msgpack
import numpy as np

from ..errors import MismatchError, RemoteProtocolError
from ..transport.base import Connection

__all__ = ["CollectiveLink", "describe_call"]


def describe_call(
    name: str, op: str, dtype: str, shape: Sequence[int], root: int | None = None
) -> bytes:
    """The descriptor ranks compare to check that they called the same collective.

    Encoded once per distinct call and remembered (a loop repeats the same few calls)."""
    return _descriptor(name, op, dtype, tuple(shape), root)


@functools.lru_cache(maxsize=4096)
def _descriptor(name: str, op: str, dtype: str, shape: tuple[int, ...], root: int | None) -> bytes:
    return bytes(msgpack.packb([name, op, dtype, list(shape), root], use_bin_type=True))


def _explain(desc: bytes) -> str:
    try:
        name, op, dtype, shape, root = msgpack.unpackb(desc, raw=False)
    except Exception:
        return "an undecodable call"
    try:
        dtype = np.dtype(dtype).name if dtype else ""
    except TypeError:
        dtype = repr(dtype)
    parts = [f"{dtype}{list(shape)}"]
    if op:
        parts.append(f"op={op!r}")
    if root is not None:
        parts.append(f"root={root}")
    return f"{name}({', '.join(parts)})"


class CollectiveLink:
    """Implements :class:`~p2pdist.group.linkops.Link` for one collective call."""

    __slots__ = (
        "_conn",
        "_rank",
        "_received",
        "_sent",
        "_size",
        "channel",
        "descriptor",
        "waiting_on",
    )

    def __init__(
        self,
        rank: int,
        size: int,
        channel: int,
        descriptor: bytes,
        connection: Callable[[int], Connection],
    ) -> None:
        self._rank, self._size = rank, size
        self.channel = channel
        self.descriptor = descriptor
        self._conn = connection
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self.waiting_on: int | None = None
        """The rank this collective is blocked on right now (for timeout messages)."""

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    async def send(self, peer: int, payload: memoryview) -> None:
        """Send the next message of this collective to ``peer``."""
        seq = self._sent.get(peer, 0)
        self._sent[peer] = seq + 1
        meta = self.descriptor if seq == 0 else b""
        self.waiting_on = peer
        await self._conn(peer).send(self.channel, payload, meta=meta, seq=seq)
        self.waiting_on = None

    async def recv(self, peer: int, nbytes: int) -> memoryview:
        """The next message of this collective from ``peer``; checks order, call and size."""
        conn = self._conn(peer)
        seq = self._received.get(peer, 0)
        self._received[peer] = seq + 1
        self.waiting_on = peer
        frame = await conn.recv(self.channel)
        self.waiting_on = None
        if frame.seq != seq:
            raise RemoteProtocolError(
                conn.label, f"message {frame.seq} arrived where {seq} was due (channel reuse?)"
            )
        if seq == 0 and frame.meta != self.descriptor:
            raise MismatchError(
                conn.label,
                f"called {_explain(frame.meta)} but this rank called {_explain(self.descriptor)}",
            )
        if frame.payload.nbytes != nbytes:
            raise MismatchError(
                conn.label,
                f"sent {frame.payload.nbytes} bytes where {nbytes} were expected "
                f"in {_explain(self.descriptor)}",
            )
        return frame.payload

    def expect(self, peer: int, places: Sequence[memoryview]) -> None:
        """Receive the next ``len(places)`` messages from ``peer`` straight into
        ``places``, in order (each one that has not begun to arrive yet and has the
        place's size): :meth:`recv` returns the place itself for those. Empty places
        are skipped; the places are let go when the call ends (``retire``)."""
        conn = self._conn(peer)
        seq = self._received.get(peer, 0)
        for i, place in enumerate(places):
            if place.nbytes:
                conn.expect(self.channel, seq + i, place)

    def label(self, peer: int) -> str:
        """How errors name ``peer``."""
        return self._conn(peer).label

    def explain(self) -> str:
        """This call in words, e.g. ``all_reduce(float32[1024], op='sum')``."""
        return _explain(self.descriptor)
