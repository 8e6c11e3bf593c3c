"""Collective algorithms as schedules over a :class:`~p2pdist.group.linkops.Link`.

The algorithms only see ranks, arrays and a ``Link`` that sends bytes to a rank and
receives the next message from a rank (sized and checked by the Link). Which transport,
channel or sequence number carries a message is the Link's business.

* ring reduce-scatter / all-gather (bandwidth-optimal, chunked so that the transfer of one
  chunk overlaps the reduction of the previous one);
* pairwise reduce-scatter / all-gather (the same bytes per rank as the ring, but every
  rank exchanges its segments with every other rank at once: no chain of n-1 steps in
  which one slow rank holds up the next; chunked too);
* direct one-round exchanges for small arrays (latency-optimal: every rank reduces the
  same inputs in rank order, so all ranks get bitwise-identical results);
* a pipelined chain for broadcast;
* the rooted and personalized collectives (reduce, gather, scatter, all-to-all).

The deterministic algorithms are in :mod:`.ordered`, the compressed ones in
:mod:`.compressed_algorithms`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from ..errors import MismatchError, RemoteProtocolError
from .linkops import (
    Link,
    as_bytes,
    chunks,
    expect_each,
    expect_one_each,
    land_next,
    rank_ordered,
    recv_into,
    recv_one_each,
    send_to_others,
    view_as,
)
from .ops import ReduceOp

__all__ = [
    "ahead",
    "agree",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "chain_broadcast",
    "direct_all_gather",
    "direct_all_reduce",
    "direct_broadcast",
    "direct_reduce",
    "direct_reduce_scatter",
    "gather_segments",
    "gather_to",
    "pairwise_all_gather",
    "pairwise_reduce_scatter",
    "ring_all_gather",
    "ring_reduce_scatter",
    "pairwise_rounds",
    "ring_steps",
    "scatter_from",
]


MAX_ALL_TO_ALL_V_ROWS = 1 << 40
"""Largest row count a peer may announce (rows may be empty, so bytes alone do not bound it)."""


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


SEND_AHEAD_RATE = 1.25e9
SEND_AHEAD_BYTES = 16 << 20
"""How far the chunked algorithms' sends to a peer run ahead of what this rank has
received: what :data:`SEND_AHEAD_RATE` (10 Gbit/s) moves in the round trip measured to
that peer, at most this, and at least one chunk. With one chunk (send a chunk, then wait
for the peer's) a rank idled about half a round trip per chunk: in a namespace lab with
100 ms round trips a 16 MiB all-reduce at world 2 took 2.9 s with 1 MiB chunks and 5.5 s
with 256 KiB ones, and a 1 Gbit/s link would run at a seventh of its rate. On loopback
and LANs (round trips under about a millisecond) it stays one chunk: running ahead there
only piled up received chunks (64 MiB at world 2 took 45-53 ms against 34)."""


def ahead(link: Link, peers: list[int], chunk_bytes: int) -> int:
    """Chunks the sends to ``peers`` may run ahead of the receives (see
    :data:`SEND_AHEAD_BYTES`), and never more than a quarter of what the connections
    buffer before they stop reading: a rank blocked in a send does not receive, and two
    such ranks would wait for each other."""
    peers = list(dict.fromkeys(peers))  # (a ring of two: left is right)
    rtt = max(link.round_trip(p) for p in peers)
    room = min(link.receive_limit(p) for p in peers) // 4
    most = min(SEND_AHEAD_BYTES, rtt * SEND_AHEAD_RATE, room)
    return max(1, int(most) // max(chunk_bytes, 1))


async def ring_steps(
    link: Link,
    send_chunks: list[list[tuple[int, int]]],
    recv_chunks: list[list[tuple[int, int]]],
    send: Callable[[int, int, int], Awaitable[None]],
    receive: Callable[[int, int, int], Awaitable[None]],
    chunk_bytes: int,
    least: int = 1,
) -> None:
    """Ring steps, chunk by chunk: step k sends ``send_chunks[k]`` to the right (``await
    send(k, a, b)``) and takes ``recv_chunks[k]`` from the left (``await receive(k, a,
    b)``), where what step k sends is what step k-1 took (so ``send_chunks[k] ==
    recv_chunks[k - 1]``). A chunk goes once the chunk it forwards has been taken;
    otherwise sends run ahead of the receives by up to :func:`ahead` chunks of
    ``chunk_bytes`` (one on short round trips; at least ``least``), so the transfer of
    later chunks overlaps the handling of earlier ones and a long path stays full."""
    n = link.size
    right, left = (link.rank + 1) % n, (link.rank - 1) % n
    sends = [(k, c, ab) for k, step in enumerate(send_chunks) for c, ab in enumerate(step)]
    window = max(least, ahead(link, [right, left], chunk_bytes))
    taken = [0] * len(recv_chunks)  # chunks taken so far in each step
    sent = 0
    done = 0
    for k, step in enumerate(recv_chunks):
        for a, b in step:
            while sent < len(sends) and sent - done < window:
                j, c, (sa, sb) = sends[sent]
                if j and taken[j - 1] <= c:
                    break  # forwards a chunk not taken yet
                await send(j, sa, sb)
                sent += 1
            await receive(k, a, b)
            taken[k] += 1
            done += 1
    for j, _, (sa, sb) in sends[sent:]:  # (every chunk they forward has been taken)
        await send(j, sa, sb)


async def _ring_pass(
    link: Link,
    flat: np.ndarray,
    bounds: list[tuple[int, int]],
    chunk: int,
    lag: int,
    land: Callable[[np.ndarray, np.ndarray], object] | None,
) -> None:
    """One trip round the ring (see :func:`ring_steps`): step k sends segment
    (rank-k-lag) to the right and takes segment (rank-k-lag-1) from the left:
    ``land(flat[a:b], received)`` each chunk from the left, or with ``land=None``
    receive it straight into ``flat[a:b]``."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    item = flat.dtype.itemsize
    sends = [chunks(*bounds[(r - k - lag) % n], chunk) for k in range(n - 1)]
    recvs = [chunks(*bounds[(r - k - lag - 1) % n], chunk) for k in range(n - 1)]
    places: Iterator[memoryview] = iter(())
    if land is None:  # every chunk's place is known now: name them all before they come
        named = [as_bytes(flat[a:b]) for step in recvs for a, b in step]
        link.expect(left, named)
        places = iter(named)

    async def send(_k: int, a: int, b: int) -> None:
        await link.send(right, as_bytes(flat[a:b]))

    async def receive(_k: int, a: int, b: int) -> None:
        if land is None:
            await recv_into(link, left, next(places))
            return
        data = await link.recv(left, (b - a) * item)
        if b > a:
            land(flat[a:b], view_as(data, flat.dtype))
        del data  # let the buffer go before the next receive: fewer fresh pages

    await ring_steps(link, sends, recvs, send, receive, chunk * item)


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


async def pairwise_rounds(
    rounds: int,
    sends: int,
    window: int,
    send: Callable[[int], Awaitable[None]],
    receive: Callable[[int], Awaitable[None]],
) -> None:
    """The pairwise exchange's rounds: ``receive(i)`` for each of ``rounds``, and before
    it ``send(j)`` for the first ``sends`` rounds up to ``window`` rounds ahead of it
    (its sends never wait for a receive: the window is only what the round trip needs,
    see :func:`ahead`)."""
    sent = 0
    for i in range(rounds):
        while sent < min(sends, i + window):
            await send(sent)
            sent += 1
        await receive(i)


def _others_from_next(link: Link) -> list[int]:
    """The other ranks, starting with the next one: each rank starts its round of sends
    with a different peer, so that no rank has every other one sending to it first."""
    n, r = link.size, link.rank
    return [(r + k) % n for k in range(1, n)]


async def pairwise_reduce_scatter(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], op: ReduceOp, chunk: int
) -> None:
    """Reduce ``flat`` across ranks so that segment ``bounds[rank]`` holds the result: every
    rank sends each other rank p its copy of segment p, chunk by chunk, and reduces the
    copies of its own segment as they come. Round i sends chunk i of every other rank's
    segment (rounds run ahead of the receives as far as the round trip needs:
    :data:`SEND_AHEAD_BYTES`), and reduces chunk i of ours from each rank (in a fixed
    order, so the bits do not depend on arrival timing)."""
    r = link.rank
    others = _others_from_next(link)
    item = flat.dtype.itemsize
    mine = chunks(*bounds[r], chunk)
    theirs = {p: chunks(*bounds[p], chunk) for p in others}
    rounds = max(len(mine), *(len(c) for c in theirs.values()))

    async def send(i: int) -> None:
        for p in others:
            if i < len(theirs[p]):
                a, b = theirs[p][i]
                await link.send(p, as_bytes(flat[a:b]))

    async def receive(i: int) -> None:
        if i < len(mine):
            a, b = mine[i]
            for q in reversed(others):  # the rank that sent to us first comes first
                data = await link.recv(q, (b - a) * item)
                if b > a:
                    op.combine(flat[a:b], view_as(data, flat.dtype))
                del data  # let the buffer go before the next receive

    await pairwise_rounds(rounds, rounds, ahead(link, others, chunk * item), send, receive)


async def pairwise_all_gather(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], chunk: int
) -> None:
    """Given segment ``bounds[rank]`` of ``flat`` on each rank, fill in all the others:
    every rank sends its segment to every other rank, chunk by chunk (running ahead of
    the receives as far as the round trip needs: :data:`SEND_AHEAD_BYTES`), and each
    chunk from the others lands in its place (named before it comes)."""
    r = link.rank
    others = _others_from_next(link)
    mine = chunks(*bounds[r], chunk)
    places = {q: [as_bytes(flat[a:b]) for a, b in chunks(*bounds[q], chunk)] for q in others}
    for q in others:
        link.expect(q, places[q])
    rounds = max(len(mine), *(len(p) for p in places.values()))

    async def send(i: int) -> None:
        a, b = mine[i]
        for p in others:
            await link.send(p, as_bytes(flat[a:b]))

    async def receive(i: int) -> None:
        for q in reversed(others):
            if i < len(places[q]):
                await recv_into(link, q, places[q][i])

    window = ahead(link, others, chunk * flat.dtype.itemsize)
    await pairwise_rounds(rounds, len(mine), window, send, receive)


async def direct_all_reduce(link: Link, flat: np.ndarray, op: ReduceOp, out: np.ndarray) -> None:
    """One round: send ``flat`` to everyone, reduce all inputs in rank order into ``out``
    (which must not overlap ``flat``, or may be ``flat`` itself at world 2). The received
    bytes are read where they landed."""
    rank, size = link.rank, link.size
    payload = as_bytes(flat)
    for p in range(size):
        if p != rank:
            await link.send(p, payload)
    if size == 2:  # the latency case: one ufunc call, in rank order
        other = view_as(await link.recv(1 - rank, flat.nbytes), flat.dtype)
        if rank == 0:
            op.ufunc(flat, other, out=out)
        else:
            op.ufunc(other, flat, out=out)
        return
    _fold(await rank_ordered(link, flat), op, out)


async def direct_reduce_scatter(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], op: ReduceOp, out: np.ndarray
) -> None:
    """One round: send segment p to rank p; reduce the pieces of ours in rank order."""
    r = link.rank
    for p in range(link.size):
        if p != r:
            a, b = bounds[p]
            await link.send(p, as_bytes(flat[a:b]))
    a, b = bounds[r]
    _fold(await rank_ordered(link, flat[a:b]), op, out)


async def direct_all_gather(link: Link, block: np.ndarray, out: np.ndarray) -> None:
    """One round: send our block to everyone; ``out[p]`` receives rank p's block."""
    r = link.rank
    out[r] = block  # first: ``block`` may be another row of ``out``, where a message lands
    places = expect_one_each(link, out)
    await send_to_others(link, as_bytes(out[r : r + 1]))
    await recv_one_each(link, places)


async def direct_broadcast(link: Link, flat: np.ndarray, src: int) -> None:
    """``src`` sends ``flat`` to every rank, which writes it into its own ``flat``."""
    if link.rank == src:
        await send_to_others(link, as_bytes(flat))
    else:
        await land_next(link, src, as_bytes(flat))


async def chain_broadcast(link: Link, flat: np.ndarray, src: int, chunk: int) -> None:
    """Pipelined chain src -> src+1 -> ...: each rank forwards a chunk as soon as it lands."""
    n, r = link.size, link.rank
    pos = (r - src) % n
    prev, nxt = (r - 1) % n, (r + 1) % n
    places = [as_bytes(flat[a:b]) for a, b in chunks(0, flat.size, chunk)]
    if pos > 0:
        link.expect(prev, places)
    for place in places:
        if pos > 0:
            await recv_into(link, prev, place)
        if pos < n - 1:
            await link.send(nxt, place)


async def agree(link: Link) -> None:
    """One round of empty messages, all to all: every rank checks every other rank's call
    descriptor (it travels with the first message). Rooted collectives start with it, as
    otherwise ranks that disagree about the root would never hear from each other."""
    await barrier(link)


async def barrier(link: Link) -> None:
    """Everyone tells everyone it arrived; returns once all have."""
    await send_to_others(link, memoryview(b""))
    for p in range(link.size):
        if p != link.rank:
            await link.recv(p, 0)


async def gather_to(link: Link, block: np.ndarray, dst: int, out: np.ndarray | None) -> None:
    """Everyone sends ``block`` to ``dst``, which fills ``out[p]`` with rank p's block."""
    r = link.rank
    if r != dst:
        await link.send(dst, as_bytes(block))
        return
    assert out is not None
    out[r] = block  # first: ``block`` may be another row of ``out``, where a message lands
    places = expect_one_each(link, out)
    await recv_one_each(link, places)


async def gather_segments(
    link: Link, flat: np.ndarray, bounds: list[tuple[int, int]], dst: int
) -> None:
    """After a reduce-scatter, bring every rank's segment of ``flat`` to ``dst``."""
    r = link.rank
    if r != dst:
        a, b = bounds[r]
        await link.send(dst, as_bytes(flat[a:b]))
        return
    places = {p: as_bytes(flat[a:b]) for p, (a, b) in enumerate(bounds) if p != r}
    await recv_one_each(link, expect_each(link, places))


async def direct_reduce(
    link: Link, flat: np.ndarray, op: ReduceOp, dst: int, out: np.ndarray | None
) -> None:
    """Everyone sends ``flat`` to ``dst``, which folds all inputs in rank order."""
    r = link.rank
    if r != dst:
        await link.send(dst, as_bytes(flat))
        return
    assert out is not None
    _fold(await rank_ordered(link, flat), op, out)


async def scatter_from(link: Link, blocks: np.ndarray | None, src: int, out: np.ndarray) -> None:
    """``src`` sends ``blocks[p]`` to rank p; every rank writes its block into ``out``."""
    r = link.rank
    if r == src:
        assert blocks is not None
        for p in range(link.size):
            if p != r:
                await link.send(p, as_bytes(np.ascontiguousarray(blocks[p])))
        out[...] = blocks[r]
        return
    await land_next(link, src, as_bytes(out))


async def all_to_all(link: Link, blocks: np.ndarray, out: np.ndarray) -> None:
    """Rank r sends ``blocks[p]`` to p and gets p's ``blocks[r]`` in ``out[p]``."""
    n, r = link.size, link.rank
    places = expect_one_each(link, out)
    for p in range(n):
        if p != r:
            await link.send(p, as_bytes(np.ascontiguousarray(blocks[p])))
    out[r] = blocks[r]
    await recv_one_each(link, places)


async def all_to_all_v(
    link: Link,
    parts: list[np.ndarray],
    row_shape: tuple[int, ...],
    dtype: np.dtype[Any],
    max_bytes: int,
) -> list[np.ndarray]:
    """Variable-size all-to-all: rank r sends ``parts[p]`` (any number of rows, zero too)
    to p; returns what each rank sent to r. A piece a peer announces past ``max_bytes``
    (``GroupConfig.max_message_bytes``) is refused before it is allocated. Each message
    is a row count, then the rows, sent together (in call order: a rank behind in its
    calls finds each call's rows right behind its count). Every piece goes before any is
    received: pieces beyond
    what the connections buffer (four times ``max_buffered`` while a send waits) stall
    until the timeout, which says so (docs/architecture.md section 7)."""
    n, r = link.size, link.rank
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    for p in range(n):
        if p != r:
            await link.send(p, memoryview(len(parts[p]).to_bytes(8, "little")))
            await link.send(p, as_bytes(np.ascontiguousarray(parts[p])))
    result: list[np.ndarray] = []
    for p in range(n):
        if p == r:
            result.append(parts[r].copy())
            continue
        rows = int.from_bytes(await link.recv(p, 8), "little")
        if rows > MAX_ALL_TO_ALL_V_ROWS:
            raise RemoteProtocolError(link.label(p), f"announced {rows} rows for all_to_all_v")
        if rows * row_bytes > max_bytes:
            raise MismatchError(
                link.label(p),
                f"sent an all_to_all_v piece of {rows} rows of {row_bytes} bytes, over "
                f"this group's max_message_bytes={max_bytes}",
            )
        data = await link.recv(p, rows * row_bytes)
        result.append(view_as(data, dtype).reshape((rows, *row_shape)).copy())
    return result
