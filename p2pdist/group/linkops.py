"""What the collective algorithms share: the :class:`Link` they run over and the
message helpers on top of it (bytes of an array, chunk bounds, receiving into named
places, one message to or from every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Link",
    "as_bytes",
    "chunks",
    "expect_each",
    "expect_one_each",
    "land_next",
    "rank_ordered",
    "recv_into",
    "recv_one_each",
    "send_to_others",
    "split_bounds",
    "view_as",
]


class Link(Protocol):
    """What an algorithm needs from its group: ranks and sized messages."""

    @property
    def rank(self) -> int:
        """This rank."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks."""
        ...

    async def send(self, peer: int, payload: memoryview) -> None:
        """Send one message to ``peer``."""
        ...

    async def recv(self, peer: int, nbytes: int) -> memoryview:
        """The next message from ``peer``, which must be ``nbytes`` long."""
        ...

    def expect(self, peer: int, places: Sequence[memoryview]) -> None:
        """Receive the next ``len(places)`` messages from ``peer`` straight into
        ``places``, in order, where they have not begun to arrive yet; :meth:`recv` then
        returns the place itself (see :func:`recv_into`)."""
        ...

    def label(self, peer: int) -> str:
        """How errors name ``peer``."""
        ...

    def round_trip(self, peer: int) -> float:
        """The round-trip time measured to ``peer``, seconds (0 until one was)."""
        ...

    def receive_limit(self, peer: int) -> int:
        """Bytes the connection to ``peer`` buffers before it stops reading."""
        ...


def split_bounds(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` pieces of ``n`` items (numpy.array_split rule),
    in whole units of ``align`` items (only the last piece with items may end short)."""
    units = -(-n // align)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((min(start * align, n), min(end * align, n)))
        start = end
    return bounds


def chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of at most ``step`` elements; one empty piece
    for an empty range (so that one empty message still goes)."""
    if end <= start:
        return [(start, start)]
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def as_bytes(a: np.ndarray) -> memoryview:
    """The bytes of C-contiguous ``a``, without a copy (an empty view when empty)."""
    return a.data.cast("B") if a.size else memoryview(b"")


def view_as(payload: memoryview, dtype: np.dtype[Any]) -> np.ndarray:
    """``payload`` seen as a 1-D array of ``dtype``, without a copy."""
    return np.frombuffer(payload, dtype=dtype) if payload.nbytes else np.empty(0, dtype)


async def recv_into(link: Link, peer: int, place: memoryview) -> None:
    """Receive the next message from ``peer`` into ``place``: nothing to do if it was
    received there (named by ``link.expect``), one copy if it came before it was named."""
    data = await link.recv(peer, place.nbytes)
    if data is not place and place.nbytes:
        place[:] = data


async def land_next(link: Link, peer: int, place: memoryview) -> None:
    """Receive the next message from ``peer`` into ``place``, named before it comes."""
    link.expect(peer, (place,))
    await recv_into(link, peer, place)


def expect_each(link: Link, places: dict[int, memoryview]) -> dict[int, memoryview]:
    """Name ``places[p]`` as the place of the next message from each rank p."""
    for p, place in places.items():
        link.expect(p, (place,))
    return places


def expect_one_each(link: Link, out: np.ndarray) -> dict[int, memoryview]:
    """Name ``out[p]`` as the place of the next message from every other rank p."""
    # out[p : p + 1], not out[p]: for a 1-D ``out`` that would be a read-only scalar
    return expect_each(
        link, {p: as_bytes(out[p : p + 1]) for p in range(link.size) if p != link.rank}
    )


async def recv_one_each(link: Link, places: dict[int, memoryview]) -> None:
    """Receive one message from every rank in ``places`` into its place, in rank order."""
    for p, place in places.items():
        await recv_into(link, p, place)


async def send_to_others(link: Link, payload: memoryview) -> None:
    """Send the same message to every other rank."""
    for p in range(link.size):
        if p != link.rank:
            await link.send(p, payload)


async def rank_ordered(link: Link, mine: np.ndarray) -> list[np.ndarray]:
    """One ``mine``-sized piece from every rank, in rank order (ours is ``mine`` itself)."""
    return [
        mine if p == link.rank else view_as(await link.recv(p, mine.nbytes), mine.dtype)
        for p in range(link.size)
    ]
