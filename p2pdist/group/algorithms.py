"""Collective algorithms as schedules over a :class:`Link`.

The algorithms only see ranks, arrays and a ``Link`` that sends bytes to a rank and
receives the next message from a rank (sized and checked by the Link). Which transport,
channel or sequence number carries a message is the Link's business.

* ring reduce-scatter / all-gather (bandwidth-optimal, chunked so that the transfer of one
  chunk overlaps the reduction of the previous one);
* direct one-round exchanges for small arrays (latency-optimal: every rank reduces the
  same inputs in rank order, so all ranks get bitwise-identical results);
* a pipelined chain for broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import zip_longest
from typing import Any, Protocol

import numpy as np

from ..errors import RemoteProtocolError
from .compress import WireCodec
from .ops import ReduceOp

__all__ = [
    "Link",
    "agree",
    "all_to_all",
    "all_to_all_v",
    "direct_reduce",
    "gather_segments",
    "gather_to",
    "scatter_from",
    "barrier",
    "chain_broadcast",
    "compressed_direct_all_reduce",
    "compressed_ring_all_reduce",
    "direct_all_gather",
    "direct_all_reduce",
    "direct_broadcast",
    "direct_reduce_scatter",
    "ordered_all_reduce",
    "ordered_reduce",
    "ordered_reduce_scatter",
    "ring_all_gather",
    "ring_reduce_scatter",
    "split_bounds",
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
        returns the place itself (see :func:`_recv_into`)."""
        ...

    def label(self, peer: int) -> str:
        """How errors name ``peer``."""
        ...


MAX_ALL_TO_ALL_V_BYTES = 1 << 40
"""Largest piece a peer may announce in all_to_all_v (1 TiB: a sanity bound)."""
MAX_ALL_TO_ALL_V_ROWS = 1 << 40
"""Largest row count a peer may announce (rows may be empty, so bytes alone do not bound it)."""


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` pieces of ``n`` items (numpy.array_split rule)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    if end <= start:
        return [(start, start)]
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def _bytes(a: np.ndarray) -> memoryview:
    return a.data.cast("B") if a.size else memoryview(b"")


def _view(payload: memoryview, dtype: np.dtype[Any]) -> np.ndarray:
    return np.frombuffer(payload, dtype=dtype) if payload.nbytes else np.empty(0, dtype)


async def _recv_into(link: Link, peer: int, place: memoryview) -> None:
    """Receive the next message from ``peer`` into ``place``: nothing to do if it was
    received there (named by ``link.expect``), one copy if it came before it was named."""
    data = await link.recv(peer, place.nbytes)
    if data is not place and place.nbytes:
        place[:] = data


async def _land(link: Link, peer: int, place: memoryview) -> None:
    """Receive the next message from ``peer`` into ``place``, named before it comes."""
    link.expect(peer, (place,))
    await _recv_into(link, peer, place)


def _expect_each(link: Link, places: dict[int, memoryview]) -> dict[int, memoryview]:
    """Name ``places[p]`` as the place of the next message from each rank p."""
    for p, place in places.items():
        link.expect(p, (place,))
    return places


def _expect_one_each(link: Link, out: np.ndarray) -> dict[int, memoryview]:
    """Name ``out[p]`` as the place of the next message from every other rank p."""
    # out[p : p + 1], not out[p]: for a 1-D ``out`` that would be a read-only scalar
    return _expect_each(
        link, {p: _bytes(out[p : p + 1]) for p in range(link.size) if p != link.rank}
    )


async def _recv_one_each(link: Link, places: dict[int, memoryview]) -> None:
    """Receive one message from every rank in ``places`` into its place, in rank order."""
    for p, place in places.items():
        await _recv_into(link, p, place)


async def _send_to_others(link: Link, payload: memoryview) -> None:
    """Send the same message to every other rank."""
    for p in range(link.size):
        if p != link.rank:
            await link.send(p, payload)


async def _rank_ordered(link: Link, mine: np.ndarray) -> list[np.ndarray]:
    """One ``mine``-sized piece from every rank, in rank order (ours is ``mine`` itself)."""
    return [
        mine if p == link.rank else _view(await link.recv(p, mine.nbytes), mine.dtype)
        for p in range(link.size)
    ]


def _fold(parts: list[np.ndarray], op: ReduceOp, out: np.ndarray) -> None:
    """``out = parts[0] (op) parts[1] (op) ...``, left to right in ``out``'s dtype.

    ``out`` may be one of the parts (an in-place reduce_scatter's own piece): the first
    step reads parts 0 and 1 before it writes, and a later part that ``out`` overlaps is
    copied first, as the first step overwrites it."""
    if len(parts) < 2:
        np.copyto(out, parts[0])
        return
    if len(parts) > 2:
        parts = [
            p.copy() if i > 1 and np.may_share_memory(p, out) else p for i, p in enumerate(parts)
        ]
    op.ufunc(parts[0], parts[1], out=out)  # the first step lands in out: no copy
    for part in parts[2:]:
        op.combine(out, part)


def _ring_schedule(
    link: Link, bounds: list[tuple[int, int]], chunk: int, lag: int
) -> Iterator[tuple[tuple[int, int] | None, tuple[int, int] | None]]:
    """The ring's (chunk to send right, chunk to receive from the left) pairs, in order.

    Step k sends segment (rank-k-lag) and receives segment (rank-k-lag-1), chunk by chunk
    and interleaved, so that the transfer of one chunk overlaps the handling of the last.
    """
    n, r = link.size, link.rank
    for k in range(n - 1):
        sends = _chunks(*bounds[(r - k - lag) % n], chunk)
        recvs = _chunks(*bounds[(r - k - lag - 1) % n], chunk)
        yield from zip_longest(sends, recvs)


async def _ring_pass(
    link: Link,
    flat: np.ndarray,
    bounds: list[tuple[int, int]],
    chunk: int,
    lag: int,
    land: Callable[[np.ndarray, np.ndarray], object] | None,
) -> None:
    """One trip round the ring (see :func:`_ring_schedule`): send each chunk to the right,
    and ``land(flat[a:b], received)`` each chunk from the left; with ``land=None`` each
    chunk from the left is received straight into ``flat[a:b]``."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    item = flat.dtype.itemsize
    schedule = list(_ring_schedule(link, bounds, chunk, lag))
    places: Iterator[memoryview] = iter(())
    if land is None:  # every chunk's place is known now: name them all before they come
        named = [_bytes(flat[c[0] : c[1]]) for _, c in schedule if c is not None]
        link.expect(left, named)
        places = iter(named)
    for send, recv in schedule:
        if send is not None:
            a, b = send
            await link.send(right, _bytes(flat[a:b]))
        if recv is not None:
            if land is None:
                await _recv_into(link, left, next(places))
                continue
            a, b = recv
            data = await link.recv(left, (b - a) * item)
            if b > a:
                land(flat[a:b], _view(data, flat.dtype))
            del data  # let the buffer go before the next receive: fewer fresh pages


async def ring_reduce_scatter(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], op: ReduceOp, chunk: int
) -> None:
    """Reduce ``flat`` across ranks so that segment ``bounds[rank]`` holds the result.

    Step k sends segment (rank-k-1) to the right and reduces segment (rank-k-2) from the
    left into ours; after size-1 steps this rank's own segment has every contribution.
    """
    await _ring_pass(link, flat, bounds, chunk, 1, op.combine)


async def ring_all_gather(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], chunk: int
) -> None:
    """Given segment ``bounds[rank]`` of ``flat`` on each rank, fill in all the others."""
    await _ring_pass(link, flat, bounds, chunk, 0, None)


async def direct_all_reduce(link: Link, flat: np.ndarray, op: ReduceOp, out: np.ndarray) -> None:
    """One round: send ``flat`` to everyone, reduce all inputs in rank order into ``out``
    (which must not overlap ``flat``, or may be ``flat`` itself at world 2). The received
    bytes are read where they landed."""
    rank, size = link.rank, link.size
    payload = _bytes(flat)
    for p in range(size):
        if p != rank:
            await link.send(p, payload)
    if size == 2:  # the latency case: one ufunc call, in rank order
        other = _view(await link.recv(1 - rank, flat.nbytes), flat.dtype)
        if rank == 0:
            op.ufunc(flat, other, out=out)
        else:
            op.ufunc(other, flat, out=out)
        return
    _fold(await _rank_ordered(link, flat), op, out)


async def direct_reduce_scatter(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], op: ReduceOp, out: np.ndarray
) -> None:
    """One round: send segment p to rank p; reduce the pieces of ours in rank order."""
    r = link.rank
    for p in range(link.size):
        if p != r:
            a, b = bounds[p]
            await link.send(p, _bytes(flat[a:b]))
    a, b = bounds[r]
    _fold(await _rank_ordered(link, flat[a:b]), op, out)


async def direct_all_gather(link: Link, block: np.ndarray, out: np.ndarray) -> None:
    """One round: send our block to everyone; ``out[p]`` receives rank p's block."""
    r = link.rank
    out[r] = block  # first: ``block`` may be another row of ``out``, where a message lands
    places = _expect_one_each(link, out)
    await _send_to_others(link, _bytes(out[r : r + 1]))
    await _recv_one_each(link, places)


async def direct_broadcast(link: Link, flat: np.ndarray, src: int) -> None:
    """``src`` sends ``flat`` to every rank, which writes it into its own ``flat``."""
    if link.rank == src:
        await _send_to_others(link, _bytes(flat))
    else:
        await _land(link, src, _bytes(flat))


async def chain_broadcast(link: Link, flat: np.ndarray, src: int, chunk: int) -> None:
    """Pipelined chain src -> src+1 -> ...: each rank forwards a chunk as soon as it lands."""
    n, r = link.size, link.rank
    pos = (r - src) % n
    prev, nxt = (r - 1) % n, (r + 1) % n
    places = [_bytes(flat[a:b]) for a, b in _chunks(0, flat.size, chunk)]
    if pos > 0:
        link.expect(prev, places)
    for place in places:
        if pos > 0:
            await _recv_into(link, prev, place)
        if pos < n - 1:
            await link.send(nxt, place)


async def agree(link: Link) -> None:
    """One round of empty messages, all to all: every rank checks every other rank's call
    descriptor (it travels with the first message). Rooted collectives start with it, as
    otherwise ranks that disagree about the root would never hear from each other."""
    await barrier(link)


async def barrier(link: Link) -> None:
    """Everyone tells everyone it arrived; returns once all have."""
    await _send_to_others(link, memoryview(b""))
    for p in range(link.size):
        if p != link.rank:
            await link.recv(p, 0)


_FOLD_BLOCK = 32 * 1024
"""Elements per float64 block of :func:`ordered_reduce` (256 KiB: stays in L2)."""


def fold_scratch(dtype: np.dtype[Any], n: int) -> np.ndarray:
    """Scratch for :func:`ordered_reduce` of up to ``n`` elements of ``dtype``."""
    wide = np.promote_types(dtype, np.float64)
    return np.empty((2, min(_FOLD_BLOCK, max(n, 1))), wide)


def ordered_reduce(
    parts: list[np.ndarray],
    op: ReduceOp,
    world: int,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """``out = round(parts[0] (op) parts[1] (op) ...)``, folded left to right in float64
    (complex128 for complex), in cache-sized blocks, rounded once into ``out``.

    Each block widens its inputs into ``scratch`` (from :func:`fold_scratch`; made here
    when None) with plain casts and folds them with same-dtype ufuncs: the same float64
    operations as ``op.ufunc(acc, part, dtype=float64)``, without the buffered mixed-dtype
    loops (about 20% faster)."""
    if len(parts) == 2 and not op.divide and out.dtype.kind == "f" and out.dtype.itemsize <= 4:
        # One float64 add or multiply of two float32 (or float16) values, rounded to
        # float32, is the correctly rounded float32 operation itself (53 >= 2 * 24 + 2
        # bits: double rounding is innocuous). Same bits, no casts.
        op.ufunc(parts[0], parts[1], out=out)
        return
    if scratch is None:
        scratch = fold_scratch(out.dtype, out.size)
    wide = scratch.dtype
    block = scratch.shape[1]
    for s0 in range(0, out.size, block):
        s1 = min(s0 + block, out.size)
        acc, tmp = scratch[0, : s1 - s0], scratch[1, : s1 - s0]
        np.copyto(acc, parts[0][s0:s1])  # widening: exact
        for part in parts[1:]:
            piece = part[s0:s1]
            if piece.dtype != wide:
                np.copyto(tmp, piece)
                piece = tmp
            op.ufunc(acc, piece, out=acc)
        if op.divide:
            acc /= world
        np.copyto(out[s0:s1], acc, casting="same_kind")  # the single rounding


async def ordered_all_reduce(link: Link, flat: np.ndarray, op: ReduceOp, out: np.ndarray) -> None:
    """Deterministic one-round all-reduce for small arrays: everyone sends everything,
    everyone folds all inputs in rank order in float64 (same bits everywhere)."""
    await _send_to_others(link, _bytes(flat))
    ordered_reduce(await _rank_ordered(link, flat), op, link.size, out)


async def ordered_reduce_scatter(
    link: Link,
    flat: np.ndarray,
    bounds: list[tuple[int, int]],
    op: ReduceOp,
    chunk: int,
    out: np.ndarray,
) -> None:
    """Deterministic reduce-scatter: this rank's segment, reduced in rank order in float64.

    Every rank sends segment p of its input straight to rank p. The owner folds the
    contributions in the fixed order rank 0, 1, ..., n-1 in float64 (complex128 for complex
    inputs) and rounds once into ``out`` (its segment, in the input dtype), so the result
    does not depend on arrival timing, on where a ring would start, or on chunk sizes.
    """
    n, r = link.size, link.rank
    item = flat.dtype.itemsize
    pieces = [_chunks(a, b, chunk) for a, b in bounds]
    a, b = bounds[r]
    scratch = fold_scratch(flat.dtype, min(chunk, b - a))

    async def send_chunk(i: int) -> None:
        for p in range(n):
            if p != r and i < len(pieces[p]):
                c0, c1 = pieces[p][i]
                await link.send(p, _bytes(flat[c0:c1]))

    # Interleave, one chunk ahead: send chunk i+1 of every other rank's piece, then fold
    # our chunk i, so the next chunks travel while this one is folded and no large
    # backlog builds up.
    await send_chunk(0)
    for i in range(max(len(c) for c in pieces)):
        await send_chunk(i + 1)
        if i < len(pieces[r]):
            c0, c1 = pieces[r][i]
            parts = [
                flat[c0:c1] if p == r else _view(await link.recv(p, (c1 - c0) * item), flat.dtype)
                for p in range(n)
            ]
            ordered_reduce(parts, op, n, out[c0 - a : c1 - a], scratch)


async def compressed_ring_all_reduce(
    link: Link, work: np.ndarray, bounds: list[tuple[int, int]], codec: WireCodec, chunk: int
) -> None:
    """Sum float32 ``work`` over ranks with a narrow wire format, in place.

    Reduce-scatter: every hop decodes the incoming partial sum and adds it in float32,
    then re-encodes (fresh int8 scales per hop, so partial sums never saturate). The owner
    then encodes its final segment once and those same bytes travel the all-gather ring;
    the owner keeps the decoded value too, so every rank ends with identical bits.

    ``chunk`` counts float32 elements; the ring widens it so that a wire message has about
    ``4 * chunk`` bytes. No full-size temporaries: chunks are encoded into one reused
    buffer (a send hands its bytes to the transport before it returns), received chunks
    are accumulated or decoded straight into ``work`` and forwarded as received. The
    last reduce-scatter step and the first all-gather step run interleaved chunk by
    chunk, so a finished chunk leaves while the next ones are still being reduced (see
    ``_last_hop``).
    """
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    # Chunks whose wire size is what a float32 chunk would be: as many messages as the
    # plain ring would send for a quarter (int8) or half (16-bit) of the bytes.
    chunk = max(chunk, 4 * chunk * chunk // max(1, codec.nbytes(chunk)))
    widest = min(chunk, max(b - a for a, b in bounds))
    wire = np.empty(codec.nbytes(widest), np.uint8)

    def encoded(a: int, b: int) -> memoryview:
        buf = wire[: codec.nbytes(b - a)]
        codec.encode_into(work[a:b], buf)
        return _bytes(buf)

    for k in range(n - 2):  # reduce-scatter steps but the last
        sends = _chunks(*bounds[(r - k - 1) % n], chunk)
        recvs = _chunks(*bounds[(r - k - 2) % n], chunk)
        for send, recv in zip_longest(sends, recvs):
            if send is not None:
                await link.send(right, encoded(*send))
            if recv is not None:
                a, b = recv
                data = await link.recv(left, codec.nbytes(b - a))
                if b > a:
                    codec.accumulate(data, work[a:b])
                del data
    held = await _last_hop(link, work, bounds, codec, chunk, encoded)
    for k in range(1, n - 1):  # the other all-gather steps: forward what arrived
        forward, held = held, []
        for fwd, recv in zip_longest(forward, _chunks(*bounds[(r - k - 1) % n], chunk)):
            if fwd is not None:
                await link.send(right, fwd)
            if recv is not None:
                a, b = recv
                data = await link.recv(left, codec.nbytes(b - a))
                codec.decode_into(data, work[a:b])
                if k < n - 2:  # forwarded in the next step; else let the buffer go
                    held.append(data)
                del data


async def _last_hop(
    link: Link,
    work: np.ndarray,
    bounds: list[tuple[int, int]],
    codec: WireCodec,
    chunk: int,
    encoded: Callable[[int, int], memoryview],
) -> list[memoryview]:
    """The last reduce-scatter step fused with the first all-gather step.

    Iteration i sends partial-sum chunk i of segment rank+1, then the final encoding of
    our own chunk i-1 (finished one iteration earlier, so nothing waits on it), then
    receives our own chunk i (the last contribution) and segment rank-1's final chunk
    i-1. The left neighbour sends exactly that sequence, so messages pair up in order.
    Returns the all-gather chunks received, for forwarding (none with two ranks).
    """
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    partial = _chunks(*bounds[(r + 1) % n], chunk)
    own = _chunks(*bounds[r], chunk)
    final = _chunks(*bounds[(r - 1) % n], chunk)
    held: list[memoryview] = []
    for i in range(max(len(partial), len(own) + 1, len(final) + 1)):
        if i < len(partial):
            await link.send(right, encoded(*partial[i]))
        if 0 < i <= len(own):
            a, b = own[i - 1]
            payload = encoded(a, b)
            codec.decode_into(payload, work[a:b])  # keep exactly what the others get
            await link.send(right, payload)
        if i < len(own):
            a, b = own[i]
            data = await link.recv(left, codec.nbytes(b - a))
            if b > a:
                codec.accumulate(data, work[a:b])
            del data
        if 0 < i <= len(final):
            a, b = final[i - 1]
            data = await link.recv(left, codec.nbytes(b - a))
            codec.decode_into(data, work[a:b])
            if n > 2:  # forwarded by the next all-gather step
                held.append(data)
            del data
    return held


async def compressed_direct_all_reduce(link: Link, work: np.ndarray, codec: WireCodec) -> None:
    """One round: everyone sends ``encode(work)`` to everyone; everyone decodes all inputs
    (its own included) and sums them in rank order in float32, in place. A float16 sum
    that float16 cannot hold (|sum| >= 65520) becomes inf, as the ring's final encoding
    makes it, so both paths agree on the range. The sum is not rounded to the wire
    dtype again: that would add an error that error feedback cannot take back."""
    n, r = link.size, link.rank
    enc = codec.encode(work)
    payload = _bytes(enc)
    await _send_to_others(link, payload)
    for p in range(n):
        data = payload if p == r else await link.recv(p, len(payload))
        if p == 0:
            codec.decode_into(data, work)
        else:
            codec.accumulate(data, work)
    if codec.name == "float16":
        over = np.abs(work) >= _F16_OVERFLOW
        if over.any():
            np.copyto(work, np.copysign(np.float32(np.inf), work), where=over)


_F16_OVERFLOW = np.float32(65520.0)
"""float32 values of at least this magnitude round to an infinity in float16."""


async def gather_to(link: Link, block: np.ndarray, dst: int, out: np.ndarray | None) -> None:
    """Everyone sends ``block`` to ``dst``, which fills ``out[p]`` with rank p's block."""
    r = link.rank
    if r != dst:
        await link.send(dst, _bytes(block))
        return
    assert out is not None
    out[r] = block  # first: ``block`` may be another row of ``out``, where a message lands
    places = _expect_one_each(link, out)
    await _recv_one_each(link, places)


async def gather_segments(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], dst: int
) -> None:
    """After a reduce-scatter, bring every rank's segment of ``flat`` to ``dst``."""
    r = link.rank
    if r != dst:
        a, b = bounds[r]
        await link.send(dst, _bytes(flat[a:b]))
        return
    places = {p: _bytes(flat[a:b]) for p, (a, b) in enumerate(bounds) if p != r}
    await _recv_one_each(link, _expect_each(link, places))


async def direct_reduce(
    link: Link, flat: np.ndarray, op: ReduceOp, dst: int, out: np.ndarray | None
) -> None:
    """Everyone sends ``flat`` to ``dst``, which folds all inputs in rank order."""
    r = link.rank
    if r != dst:
        await link.send(dst, _bytes(flat))
        return
    assert out is not None
    _fold(await _rank_ordered(link, flat), op, out)


async def scatter_from(link: Link, blocks: np.ndarray | None, src: int, out: np.ndarray) -> None:
    """``src`` sends ``blocks[p]`` to rank p; every rank writes its block into ``out``."""
    r = link.rank
    if r == src:
        assert blocks is not None
        for p in range(link.size):
            if p != r:
                await link.send(p, _bytes(np.ascontiguousarray(blocks[p])))
        out[...] = blocks[r]
        return
    await _land(link, src, _bytes(out))


async def all_to_all(link: Link, blocks: np.ndarray, out: np.ndarray) -> None:
    """Rank r sends ``blocks[p]`` to p and gets p's ``blocks[r]`` in ``out[p]``."""
    n, r = link.size, link.rank
    places = _expect_one_each(link, out)
    for p in range(n):
        if p != r:
            await link.send(p, _bytes(np.ascontiguousarray(blocks[p])))
    out[r] = blocks[r]
    await _recv_one_each(link, places)


async def all_to_all_v(
    link: Link, parts: list[np.ndarray], row_shape: tuple[int, ...], dtype: np.dtype[Any]
) -> list[np.ndarray]:
    """Variable-size all-to-all: rank r sends ``parts[p]`` (any number of rows, zero too)
    to p; returns what each rank sent to r. Each message is a row count, then the rows."""
    n, r = link.size, link.rank
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    for p in range(n):
        if p != r:
            await link.send(p, memoryview(len(parts[p]).to_bytes(8, "little")))
            await link.send(p, _bytes(np.ascontiguousarray(parts[p])))
    result: list[np.ndarray] = []
    for p in range(n):
        if p == r:
            result.append(parts[r].copy())
            continue
        rows = int.from_bytes(await link.recv(p, 8), "little")
        if rows > MAX_ALL_TO_ALL_V_ROWS or rows * row_bytes > MAX_ALL_TO_ALL_V_BYTES:
            raise RemoteProtocolError(link.label(p), f"announced {rows} rows for all_to_all_v")
        data = await link.recv(p, rows * row_bytes)
        result.append(_view(data, dtype).reshape((rows, *row_shape)).copy())
    return result
