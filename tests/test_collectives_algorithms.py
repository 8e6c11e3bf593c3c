"""The ring and the pairwise exchange for arrays above ``small_bytes``: both give numpy's
result, identical on every rank, for every collective that uses them, including
segments that are empty or end inside a chunk. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
import pytest
from group_helpers import groups, loopback_peers

from p2pdist import Group, GroupConfig, UsageError
from p2pdist.group import algorithms
from p2pdist.group.config import PAIRWISE_MAX_WORLD
from p2pdist.group.linkops import split_bounds
from p2pdist.group.ops import reduce_op

ALGORITHMS = ["ring", "pairwise"]
SEED = "algorithms-seed-0123456789"


def inputs(world: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(world * 1000 + n)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("n", [1, 3, 5, 1000, 4099])  # with chunks of 1024 elements
async def test_all_reduce_reduce_scatter_all_gather_and_reduce(
    algorithm: str, world: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []
    for name in (
        "ring_reduce_scatter",
        "pairwise_reduce_scatter",
        "ring_all_gather",
        "pairwise_all_gather",
    ):
        real = getattr(algorithms, name)

        def counted(*args: object, _real: object = real, _name: str = name) -> object:
            ran.append(_name)
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(algorithms, name, counted)
    # small_bytes=0: every array takes the algorithm, even one with fewer items than
    # ranks (empty segments); chunk_bytes=4096: several chunks, the last one short.
    config = {"small_bytes": 0, "chunk_bytes": 4096, "algorithm": algorithm}
    xs = inputs(world, n)
    want = np.sum(np.array(xs, np.float64), axis=0)
    async with groups(world, config=config) as gs:
        sums = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(gs, xs, strict=True)))
        for out in sums:
            np.testing.assert_array_equal(out, sums[0])
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        means = await asyncio.gather(
            *(g.all_reduce(x, "mean", out=x.copy()) for g, x in zip(gs, xs, strict=True))
        )
        np.testing.assert_allclose(means[0], want / world, rtol=1e-5, atol=1e-5)
        pieces = await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(gs, xs, strict=True)))
        for piece, part in zip(pieces, np.array_split(want, world), strict=True):
            np.testing.assert_allclose(piece, part, rtol=1e-5, atol=1e-5)
        rows = await asyncio.gather(*(g.all_gather(x) for g, x in zip(gs, xs, strict=True)))
        for row in rows:
            np.testing.assert_array_equal(row, np.array(xs))
        roots = await asyncio.gather(*(g.reduce(x, 1) for g, x in zip(gs, xs, strict=True)))
        assert roots[0] is None and roots[1] is not None
        np.testing.assert_allclose(roots[1], want, rtol=1e-5, atol=1e-5)
    assert set(ran) == {f"{algorithm}_reduce_scatter", f"{algorithm}_all_gather"}, ran


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_the_algorithms_run_side_by_side_with_other_collectives(algorithm: str) -> None:
    """Several large all-reduces in flight at once, on a sub-group and the parent."""
    config = {"chunk_bytes": 64 * 1024, "algorithm": algorithm}
    async with groups(4, config=config) as gs:
        subs = await asyncio.gather(*(g.split(g.rank % 2) for g in gs))
        xs = inputs(4, 100_000)
        calls = [
            asyncio.gather(*(g.all_reduce(x) for g, x in zip(gs, xs, strict=True))),
            asyncio.gather(*(s.all_reduce(x) for s, x in zip(subs, xs, strict=True))),
            asyncio.gather(*(g.all_reduce(2 * x) for g, x in zip(gs, xs, strict=True))),
        ]
        whole, halves, doubled = await asyncio.gather(*calls)
        want = np.sum(np.array(xs, np.float64), axis=0)
        for r in range(4):
            np.testing.assert_allclose(whole[r], want, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(doubled[r], 2 * want, rtol=1e-5, atol=1e-4)
            same_colour = [xs[p] for p in range(4) if p % 2 == r % 2]
            np.testing.assert_allclose(halves[r], np.sum(same_colour, axis=0), rtol=1e-5)


@pytest.mark.parametrize(
    ("world", "algorithm", "pairwise"),
    [
        (2, "auto", False),  # at 2 ranks the two are the same exchange: the ring's code
        (3, "auto", True),
        (4, "auto", True),
        (5, "auto", False),
        (5, "pairwise", True),
        (3, "ring", False),
    ],
)
def test_auto_takes_pairwise_up_to_its_world_and_the_ring_above(
    world: int, algorithm: str, pairwise: bool
) -> None:
    assert PAIRWISE_MAX_WORLD == 4  # where it was measured (docs/performance.md)
    config = GroupConfig(algorithm=algorithm)
    g = Group.from_seed(SEED, rank=0, world=world, peers=loopback_peers(world), config=config)
    assert g._pairwise() is pairwise
    with pytest.raises(UsageError, match="algorithm must be one of"):
        GroupConfig(algorithm="tree")


# ---- running ahead on long round trips ------------------------------------------------


class MemoryLink:
    """A Link between ranks of one process (a queue per direction) that claims a round
    trip of ``rtt`` seconds to every peer, and logs this rank's sends and receives."""

    def __init__(self, rank: int, size: int, queues: dict[tuple[int, int], Any], rtt: float):
        self.rank, self.size, self.rtt = rank, size, rtt
        self._queues = queues
        self.log: list[str] = []

    async def send(self, peer: int, payload: memoryview) -> None:
        self.log.append("send")
        self._queues[self.rank, peer].put_nowait(bytes(payload))
        await asyncio.sleep(0)

    async def recv(self, peer: int, nbytes: int) -> memoryview:
        data = await self._queues[peer, self.rank].get()
        assert len(data) == nbytes
        self.log.append("recv")
        return memoryview(data)

    def expect(self, peer: int, places: Any) -> None:
        pass  # (received data is copied into its place)

    def label(self, peer: int) -> str:
        return f"rank {peer}"

    def round_trip(self, peer: int) -> float:
        return self.rtt

    def receive_limit(self, peer: int) -> int:
        return 512 << 20


def memory_links(world: int, rtt: float) -> list[MemoryLink]:
    queues = {(a, b): asyncio.Queue() for a in range(world) for b in range(world) if a != b}
    return [MemoryLink(r, world, queues, rtt) for r in range(world)]


@pytest.mark.parametrize("rtt", [0.0, 0.1])
@pytest.mark.parametrize(
    ("world", "kind"), [(2, "ring"), (3, "ring"), (4, "ring"), (3, "pairwise"), (4, "pairwise")]
)
async def test_sends_run_ahead_on_long_round_trips_and_the_sums_stay_right(
    rtt: float, world: int, kind: str
) -> None:
    """With one chunk in flight per peer (send a chunk, then wait for the peer's), a rank
    idled half a round trip per chunk: 16 MiB at world 2 took 2.9 s over 100 ms round
    trips in the namespace lab (7-11 s with 10% loss), 2.3-2.7 s (3.4-5.8 s) once sends
    run ahead. Short round trips keep one chunk (running ahead there cost loopback a
    third of its speed); long ones send many chunks before the first receive, and a
    ring never forwards a chunk before it arrived (the sums show it)."""
    n, chunk_elems = 10_007, 256  # uneven segments, each many chunks
    xs = inputs(world, n)
    links = memory_links(world, rtt)
    flats = [x.copy() for x in xs]
    bounds = split_bounds(n, world)
    op = reduce_op("sum", np.dtype(np.float32))
    scatter = getattr(algorithms, f"{kind}_reduce_scatter")
    gather = getattr(algorithms, f"{kind}_all_gather")

    async def one(link: MemoryLink, flat: np.ndarray) -> None:
        await scatter(link, flat, bounds, op, chunk_elems)
        await gather(link, flat, bounds, chunk_elems)

    await asyncio.wait_for(
        asyncio.gather(*(one(lk, f) for lk, f in zip(links, flats, strict=True))), 30
    )
    want = np.sum(np.stack(xs), axis=0, dtype=np.float32)
    for f in flats:
        np.testing.assert_allclose(f, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(f, flats[0])  # the same bits everywhere
    first = links[0].log.index("recv")  # sends before this rank's first receive
    peers = 1 if kind == "ring" else world - 1
    if rtt == 0.0:  # one chunk (a round of the pairwise exchange) at a time, as before
        assert first == peers, links[0].log[:20]
    else:
        assert first >= 8 * peers, links[0].log[:20]


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_the_compressed_ring_runs_ahead_too_with_the_same_bits(world: int) -> None:
    """The compressed reduce-scatter (a narrow wire for slow links, which are mostly long
    ones) runs its sends ahead as well, and its result does not depend on it: every
    chunk's partial sums are made in ring order either way."""
    from p2pdist.group.compress import make_codec
    from p2pdist.group.compressed_algorithms import compressed_ring_reduce_scatter

    n, chunk_elems = 10_007, 256
    xs = inputs(world, n)
    bounds = split_bounds(n, world)
    results = {}
    for rtt in (0.0, 0.1):
        links = memory_links(world, rtt)
        works = [x.copy() for x in xs]
        codecs = [make_codec("bfloat16") for _ in range(world)]
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    compressed_ring_reduce_scatter(lk, w, bounds, c, chunk_elems)
                    for lk, w, c in zip(links, works, codecs, strict=True)
                )
            ),
            30,
        )
        results[rtt] = [w[a:b].copy() for w, (a, b) in zip(works, bounds, strict=True)]
        first = links[0].log.index("recv")
        assert (first >= 5) if rtt else (first == 1), links[0].log[:20]  # (5-10 chunks a segment)
    want = np.sum(np.stack(xs), axis=0, dtype=np.float32)
    for piece, fast, (a, b) in zip(results[0.0], results[0.1], bounds, strict=True):
        np.testing.assert_array_equal(piece, fast)
        np.testing.assert_allclose(piece, want[a:b], rtol=0.05, atol=0.05)


async def _run_all(links: list[MemoryLink], calls: Any) -> None:
    await asyncio.wait_for(asyncio.gather(*(calls(r, lk) for r, lk in enumerate(links))), 30)


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
async def test_the_whole_compressed_ring_runs_ahead_with_the_same_bits(
    world: int, feedback: bool
) -> None:
    """The compressed all-reduce's last reduce-scatter step and its all-gather ran one
    chunk at a time whatever the round trip (a chunk per one-way trip: bfloat16 16 MiB
    at world 2 over 100 ms round trips took 1.8-2.2 s with 256 KiB chunks against 1.2-1.6
    with 1 MiB ones); now every step runs ahead, and neither the result nor the residual
    of error feedback depends on it."""
    from p2pdist.group.compress import make_codec
    from p2pdist.group.compressed_algorithms import compressed_ring_all_reduce

    n, chunk_elems = 10_007, 256
    xs = inputs(world, n)
    bounds = split_bounds(n, world)
    results, residuals, logs = {}, {}, {}
    for rtt in (0.0, 0.1):
        links = memory_links(world, rtt)
        works = [x.copy() for x in xs]
        rests = [np.zeros(n, np.float32) if feedback else None for _ in range(world)]

        async def call(r: int, lk: MemoryLink, works: Any = works, rests: Any = rests) -> None:
            codec = make_codec("bfloat16")
            await compressed_ring_all_reduce(lk, works[r], bounds, codec, chunk_elems, rests[r])

        await _run_all(links, call)
        results[rtt], residuals[rtt], logs[rtt] = works, rests, links[0].log
    # (5-10 wire chunks a segment; two in flight at least: see the next test)
    assert logs[0.0].index("recv") == 2 and logs[0.1].index("recv") >= 5, logs[0.1][:20]
    # The all-gather's sends, too, run ahead: the last receives come in a row.
    assert logs[0.1][-5:] == ["recv"] * 5, logs[0.1][-20:]
    want = np.sum(np.stack(xs), axis=0, dtype=np.float32)
    for slow, fast in zip(results[0.0], results[0.1], strict=True):
        np.testing.assert_array_equal(slow, fast)
        np.testing.assert_array_equal(fast, results[0.1][0])  # the same bits everywhere
        np.testing.assert_allclose(fast, want, rtol=0.05, atol=0.05)
    if feedback:
        for slow, fast in zip(residuals[0.0], residuals[0.1], strict=True):
            np.testing.assert_array_equal(slow, fast)
            assert np.any(fast)


async def test_the_compressed_ring_keeps_two_chunks_in_flight_on_short_round_trips() -> None:
    """Its all-gather's first chunk left only after the last reduce-scatter step's every
    chunk with one chunk in flight (the round trip of a LAN): a one-way trip per chunk
    where the hand-fused last hop before had two chunks in flight (a reviewer counted
    16 one-way trips against 9 at world 2, 8 chunks a segment). With two in flight at
    least, the first all-gather send follows the last step's receives one behind."""
    from p2pdist.group.compress import make_codec
    from p2pdist.group.compressed_algorithms import compressed_ring_all_reduce

    n, chunk_elems = 2 * 8 * 512, 256  # bfloat16 wire chunks of 512: 8 a segment
    xs = inputs(2, n)
    links = memory_links(2, 0.0)
    works = [x.copy() for x in xs]

    async def call(r: int, lk: MemoryLink) -> None:
        codec = make_codec("bfloat16")
        await compressed_ring_all_reduce(lk, works[r], split_bounds(n, 2), codec, chunk_elems)

    await _run_all(links, call)
    log = links[0].log
    assert log == ["send", "send"] + ["recv", "send"] * 14 + ["recv", "recv"], log
    np.testing.assert_array_equal(works[0], works[1])


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_the_deterministic_reduce_scatter_runs_ahead_with_the_same_bits(
    world: int,
) -> None:
    """The deterministic reduce-scatter sent one chunk ahead of its folds whatever the
    round trip; on long ones it runs as far ahead as the others, and its result is still
    every rank's input folded in rank order in float64, rounded once."""
    from p2pdist.group.ordered import ordered_reduce_scatter

    n, chunk_elems = 10_007, 256
    xs = inputs(world, n)
    bounds = split_bounds(n, world)
    want = np.sum(np.stack(xs).astype(np.float64), axis=0).astype(np.float32)
    op = reduce_op("sum", np.dtype(np.float32))
    for rtt in (0.0, 0.1):
        links = memory_links(world, rtt)
        outs = [np.empty(b - a, np.float32) for a, b in bounds]

        async def call(r: int, lk: MemoryLink, outs: Any = outs) -> None:
            await ordered_reduce_scatter(lk, xs[r], bounds, op, chunk_elems, outs[r])

        await _run_all(links, call)
        for out, (a, b) in zip(outs, bounds, strict=True):
            np.testing.assert_array_equal(out, want[a:b])
        first = links[0].log.index("recv")
        assert first == 2 * (world - 1) if rtt == 0.0 else first >= 8 * (world - 1), first


@pytest.mark.parametrize(
    ("world", "algorithm", "kw"),
    [
        (2, "ring", {"mode": "deterministic"}),
        (3, "ring", {"mode": "deterministic"}),
        (2, "ring", {"wire_dtype": "bfloat16"}),
        (3, "ring", {"wire_dtype": "int8"}),
    ],
)
async def test_deterministic_and_compressed_runs_ahead_within_what_peers_buffer(
    world: int, algorithm: str, kw: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deterministic and compressed paths run ahead on long round trips as the plain
    ones do, within a quarter of what the connections buffer (else two ranks blocked in
    sends to each other)."""
    from p2pdist.group.link import CollectiveLink

    monkeypatch.setattr(CollectiveLink, "round_trip", lambda self, peer: 0.1)
    async with groups(
        world, timeout=30.0, config={"algorithm": algorithm}, max_buffered=1 << 20
    ) as gs:
        x = np.ones(8 << 20, np.float32)
        outs = await asyncio.wait_for(
            asyncio.gather(*(g.all_reduce(x.copy(), **kw) for g in gs)), 60
        )
        assert all(o[0] == world and o[-1] == world for o in outs)


@pytest.mark.parametrize(("world", "algorithm"), [(2, "ring"), (3, "pairwise")])
async def test_running_ahead_never_outgrows_what_the_peer_buffers(
    world: int, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks that ran 16 MiB ahead (a 100 ms round trip claimed) with max_buffered of
    1-4 MiB blocked each in a send to a peer that had stopped reading, and neither
    received: the 64 MiB all-reduce timed out. The window is at most a quarter of what
    the connections buffer."""
    from p2pdist.group.link import CollectiveLink

    monkeypatch.setattr(CollectiveLink, "round_trip", lambda self, peer: 0.1)
    for mib, high in ((1, 64 << 10), (4, 8 << 20)):
        async with groups(
            world,
            timeout=30.0,
            config={"algorithm": algorithm},
            max_buffered=mib << 20,
            write_buffer_high=high,
        ) as gs:
            x = np.ones(16 << 20, np.float32)
            outs = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x.copy()) for g in gs)), 60)
            assert all(o[0] == world and o[-1] == world for o in outs)


async def test_the_round_trip_comes_from_the_transport_not_a_late_keepalive() -> None:
    """One keepalive answer held up by a peer's blocked event loop read as a 1.5 s round
    trip on loopback, and every later collective ran 16 chunks ahead there. The round
    trip is the kernel's (TCP) or QUIC's least, which such a stall does not touch."""
    from p2pdist.group.link import CollectiveLink

    async with groups(2) as gs:
        await asyncio.gather(*(g.barrier() for g in gs))
        conn = gs[0]._conns[1]
        conn.stats.rtt = 1.5  # as a late PONG leaves it
        link = CollectiveLink(0, 2, 1, b"", gs[0]._conns.__getitem__, 0)
        if sys.platform == "linux":  # (elsewhere the kernel does not tell)
            assert 0 < link.round_trip(1) < 0.01
        assert link.receive_limit(1) == 512 << 20
