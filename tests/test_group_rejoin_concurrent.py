"""Rejoining (``rejoin=True`` under ``on_peer_loss="leave"``) when two ranks restart at
the same time, and when a second process claims a rank that has already rejoined: the
pair of rejoiners ends with one connection both keep and a whole group on every rank;
the second claimant is refused with a reason that names the situation, and the first
keeps working. Real TCP sockets on 127.0.0.1, every wait bounded."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from group_helpers import free_ports, loopback_peers, until_left

from p2pdist import Group, GroupConfig, PeerAuthenticationError, TransportConfig

SEED = "rejoin-concurrent-seed-0123456789"
# A short keepalive interval keeps the refusal of a second claimant (it waits for the
# first one's connection to go silent, up to 4 intervals) quick.
CFG = GroupConfig(
    timeout=10.0,
    connect_timeout=10.0,
    on_peer_loss="leave",
    transport=TransportConfig(tls=False, keepalive_interval=0.25, idle_timeout=5.0),
)


def make(rank: int, peers: list[str], *, rejoin: bool = False, listen: str | None = None) -> Group:
    return Group.from_seed(
        SEED, rank=rank, world=len(peers), peers=peers, config=CFG, rejoin=rejoin, listen=listen
    )


async def whole(gs: list[Group]) -> None:
    """Every rank sees nobody left, and a full all_reduce is right on every rank."""
    for g in gs:
        assert not g.left, (g.rank, dict(g.left))
        assert g.broken is None
    n = len(gs)
    out = await asyncio.wait_for(
        asyncio.gather(*(g.all_reduce(np.full(5, g.rank + 1.0)) for g in gs)), 15.0
    )
    for o in out:
        assert o.tolist() == [n * (n + 1) / 2] * 5


@pytest.mark.parametrize("first, second", [(1, 2), (2, 1), (0, 3), (3, 0)])
async def test_two_ranks_rejoining_at_once_make_a_whole_group(first: int, second: int) -> None:
    peers = loopback_peers(4)
    gs = [make(r, peers) for r in range(4)]
    back: list[Group] = []
    try:
        await asyncio.gather(*(g.start() for g in gs))
        await whole(gs)
        await gs[first].close()
        await gs[second].close()
        stay = [g for g in gs if g.rank not in (first, second)]
        await until_left(stay, first)
        await until_left(stay, second)
        back = [make(first, peers, rejoin=True), make(second, peers, rejoin=True)]
        # At the same time: `first` takes its first steps before `second` does.
        await asyncio.wait_for(asyncio.gather(*(g.start() for g in back)), 20.0)
        everyone = sorted([*stay, *back], key=lambda g: g.rank)
        await whole(everyone)
        # each pair holds exactly one live connection, the same one on both sides
        for g in everyone:
            assert sorted(g._conns) == [r for r in range(4) if r != g.rank]
            assert all(not c.closed for c in g._conns.values())
        for a in everyone:
            for b in everyone:
                if a.rank < b.rank:  # a's socket is b's, seen from the other end
                    assert ends(a, b.rank) == ends(b, a.rank)[::-1], (a.rank, b.rank)
        await whole(everyone)  # and again: both rejoiners run on the same channels
    finally:
        await asyncio.gather(*(g.close() for g in [*gs, *back]), return_exceptions=True)


def ends(g: Group, rank: int) -> tuple[tuple[str, int], tuple[str, int]]:
    """``(local, remote)`` socket addresses of ``g``'s connection to ``rank``."""
    transport = g._conns[rank]._transport  # type: ignore[attr-defined]
    local, remote = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
    return (local[0], local[1]), (remote[0], remote[1])


async def test_a_second_process_for_a_rank_that_rejoined_is_refused_and_the_first_works() -> None:
    peers = loopback_peers(3)
    gs = [make(r, peers) for r in range(3)]
    extra: list[Group] = []
    try:
        await asyncio.gather(*(g.start() for g in gs))
        await gs[2].close()
        await until_left(gs[:2], 2)
        first = make(2, peers, rejoin=True)
        extra.append(first)
        await asyncio.wait_for(first.start(), 20.0)
        everyone = [gs[0], gs[1], first]
        await whole(everyone)
        (port,) = free_ports(1)
        second = make(2, peers, rejoin=True, listen=f"127.0.0.1:{port}")
        extra.append(second)
        with pytest.raises(PeerAuthenticationError, match="two processes claim rank 2") as info:
            await asyncio.wait_for(second.start(), 20.0)
        assert "rank 2 (" in str(info.value) and "still connected from" in str(info.value)
        await asyncio.sleep(0.2)  # the refused claimant's goodbyes arrive: nothing changes
        await whole(everyone)
    finally:
        await asyncio.gather(*(g.close() for g in [*gs, *extra]), return_exceptions=True)
