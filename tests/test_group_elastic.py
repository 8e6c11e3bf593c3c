"""GroupConfig(on_peer_loss="leave"): a lost rank counts as left and the group stays
usable without it; the default still breaks. Channel-space reservation. Real TCP sockets
on 127.0.0.1; a "crash" drops a rank's sockets without a goodbye, as a killed process
does (tests/test_federated_elastic.py kills real processes)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from group_helpers import crash, groups, slow_link, until_left
from transport_conformance import wait_until

from p2pdist import (
    ConnectionBrokenError,
    Group,
    GroupBrokenError,
    GroupConfig,
    P2PError,
    UsageError,
)
from p2pdist.group.membership import FIRST_RESERVED_SPACE
from p2pdist.group.rejoin import _cut_off

LEAVE = {"on_peer_loss": "leave"}


async def until_running(g: Group) -> None:
    """Wait (bounded) until ``g`` has a collective in flight."""
    for _ in range(3000):
        if g._inflight:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the collective never started")


def test_on_peer_loss_is_checked() -> None:
    assert GroupConfig().on_peer_loss == "break"
    with pytest.raises(ValueError, match="on_peer_loss"):
        GroupConfig(on_peer_loss="ignore")


async def test_a_lost_rank_counts_as_left_and_the_rest_goes_on() -> None:
    async with groups(4, config=LEAVE) as gs:
        subs = await asyncio.gather(*(g.split(0 if g.rank < 2 else 1) for g in gs))
        crash(gs[3])
        survivors = gs[:3]
        await until_left(survivors, 3)
        for g in survivors:
            assert g.broken is None
            assert "simulated" not in str(g.left[3])  # our side's error: connection lost
            with pytest.raises(GroupBrokenError, match=r"rank 3 \(.*left the group"):
                await g.all_reduce(np.ones(4))
        # point to point among the survivors
        x = np.arange(6.0)
        await gs[0].send(x, 2)
        np.testing.assert_array_equal(await gs[2].recv(0, like=x), x)
        with pytest.raises(ConnectionBrokenError, match="rank 3"):
            await gs[1].recv(3, timeout=5)
        # a sub-group without the lost rank runs collectives; one with it refuses
        a, b = subs[0], subs[1]
        assert a is not None and b is not None
        out = await asyncio.gather(a.all_reduce(np.ones(3)), b.all_reduce(np.ones(3)))
        assert out[0].tolist() == [2.0, 2.0, 2.0]
        sub2 = subs[2]
        assert sub2 is not None and sub2.left.keys() == {1}  # rank 3 is its rank 1
        # errors name a peer by its root rank, as connections do
        with pytest.raises(GroupBrokenError, match=r"rank 3 \(.*left the group"):
            await sub2.all_reduce(np.ones(3))


async def test_a_collective_in_flight_fails_naming_the_lost_rank_and_the_group_stays() -> None:
    async with groups(3, config=LEAVE, timeout=60.0) as gs:
        # ranks 0 and 1 start an all_reduce that rank 2 never joins; then rank 2 dies.
        # Rank 0 waits on rank 1 as much as on rank 2: both must fail, naming rank 2.
        calls = [asyncio.create_task(g.all_reduce(np.ones(1 << 18, np.float32))) for g in gs[:2]]
        for g in gs[:2]:
            await until_running(g)  # both started it (a rank that had not would refuse it)
        crash(gs[2])
        results = await asyncio.gather(*calls, return_exceptions=True)
        for res in results:
            assert isinstance(res, ConnectionBrokenError), res
            assert res.peer.startswith("rank 2 (") and "all_reduce" in str(res), res
        for g in gs[:2]:
            assert g.broken is None
        y = np.ones(5)
        await gs[1].send(y, 0)
        np.testing.assert_array_equal(await gs[0].recv(1, like=y), y)


async def test_a_rank_leaving_mid_collective_fails_it_on_every_rank_at_once() -> None:
    async with groups(3, config=LEAVE, timeout=60.0) as gs:
        # rank 2 closes on purpose without joining the all_reduce: rank 0 finds its part
        # missing; rank 1, waiting on rank 0, learns it from rank 0 instead of timing out
        calls = [asyncio.create_task(g.all_reduce(np.ones(1 << 18, np.float32))) for g in gs[:2]]
        for g in gs[:2]:
            await until_running(g)  # both started it (a rank that had not would refuse it)
        await gs[2].close()
        results = await asyncio.gather(*calls, return_exceptions=True)
        for res in results:
            assert isinstance(res, ConnectionBrokenError), res
            assert res.peer.startswith("rank 2 (") and "all_reduce" in str(res), res
        assert all(g.broken is None for g in gs[:2])
        z = np.ones(3)
        await gs[0].send(z, 1)
        np.testing.assert_array_equal(await gs[1].recv(0, like=z), z)


async def test_under_leave_a_rank_whose_block_raised_leaves_with_its_reason() -> None:
    """Its leaving notice breaks nothing: the others go on without it, and the
    collectives that need it say why it left."""
    async with groups(3, config=LEAVE, timeout=20.0) as gs:
        await gs[2].__aexit__(ValueError, ValueError("bad batch (simulated)"), None)
        await until_left(gs[:2], 2)
        for g in gs[:2]:
            with pytest.raises(GroupBrokenError, match="block raised ValueError: bad batch"):
                await g.all_reduce(np.ones(3))
            assert g.broken is None
        z = np.ones(3)
        await gs[0].send(z, 1)
        np.testing.assert_array_equal(await gs[1].recv(0, like=z), z)


async def test_a_rank_every_other_rank_left_is_told_it_may_have_been_dropped() -> None:
    """A rank paused longer than idle_timeout comes back to find every other rank gone:
    they dropped it and went on. Its error said only that they left (a user's trial);
    it now says they may have dropped it, and how to join them again."""
    async with groups(3, config=LEAVE, timeout=20.0) as gs:
        await asyncio.gather(gs[0].close(), gs[1].close())
        await until_left(gs[2:], 0)
        await until_left(gs[2:], 1)
        with pytest.raises(GroupBrokenError, match="they dropped this rank") as info:
            await gs[2].all_reduce(np.ones(3))
        assert "rejoin=True" in str(info.value)


async def test_by_default_a_lost_rank_breaks_the_group_naming_it() -> None:
    async with groups(3) as gs:
        crash(gs[2])
        for g in gs[:2]:
            with pytest.raises((GroupBrokenError, ConnectionBrokenError), match=r"rank 2 \("):
                await g.all_reduce(np.ones(4), timeout=10)
            assert g.broken is not None
            assert not g.left


async def test_split_never_takes_a_reserved_space() -> None:
    async with groups(2) as gs:
        for g in gs:
            g._spaces.next = FIRST_RESERVED_SPACE - 4
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None and s._space == FIRST_RESERVED_SPACE - 4 for s in subs)
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None and s._p2p_space == FIRST_RESERVED_SPACE - 1 for s in subs)
        results = await asyncio.gather(*(g.split(0) for g in gs), return_exceptions=True)
        for res in results:
            assert isinstance(res, UsageError) and "reserved" in str(res), res


async def test_reserve_channel_space_refuses_a_taken_or_foreign_space() -> None:
    async with groups(2) as gs:
        g = gs[0]
        assert g.reserve_channel_space(0xFE07, "mine") == 0xFE07
        with pytest.raises(UsageError, match="already reserved by mine"):
            g.reserve_channel_space(0xFE07, "yours")
        sub = (await asyncio.gather(*(x.split(0) for x in gs)))[0]
        assert sub is not None
        with pytest.raises(UsageError, match="already reserved by mine"):
            sub.reserve_channel_space(0xFE07, "a sub-group's")  # shared connections
        for bad in (0, 2, 0xFDFF, 0xFFFF):
            with pytest.raises(UsageError, match="space must be in"):
                g.reserve_channel_space(bad, "x")


async def restart(old: Group, config: GroupConfig | None = None, **kw: object) -> Group:
    """Rank ``old.rank`` again, as a restarted process would be (same key and address),
    with ``old``'s config unless ``config`` is given: ``old`` is closed first."""
    await old.close()
    return rejoiner(old, config=config, **kw)


def hold_take_back(g: Group, only: int | None = None) -> asyncio.Event:
    """Make ``g`` hold its answer to a rejoining rank (``only`` that rank) until the
    returned event is set."""
    release = asyncio.Event()
    take_back = g._take_back

    async def late(rank: int, conn: Any) -> None:
        if only is None or rank == only:
            await release.wait()
        await take_back(rank, conn)

    g._take_back = late  # type: ignore[method-assign]
    return release


def rejoiner(
    old: Group,
    *,
    seed: str = "test-seed-0123456789",
    config: GroupConfig | None = None,
    **kw: object,
) -> Group:
    """A rank ``old.rank`` made with rejoin=True at ``old``'s address (``old`` as it is:
    closed or not), from ``seed``, with ``old``'s config unless ``config`` is given."""
    assert old._addresses is not None
    return Group.from_seed(
        seed,
        rank=old.rank,
        world=old.size,
        peers=old._addresses,
        config=old.config if config is None else config,
        rejoin=True,
        **kw,  # type: ignore[arg-type]
    )


def test_which_survivors_a_rejoiner_disbelieves() -> None:
    def cut(voters: dict[int, set[int]], lost: set[int] | None = None) -> list[int]:
        return _cut_off(voters, set(voters) - (lost or set()))

    assert cut({0: {3}, 2: {3}}) == []  # they agree
    # One rank cut off from the rest: it says they left, they say it left.
    assert cut({0: {1, 3}, 1: {0, 2, 3}, 2: {1, 3}}) == [1]
    # Two cut off at once go together, whether they still reach each other or not.
    assert cut({0: {3, 4}, 1: {3, 4}, 2: {3, 4}, 3: {0, 1, 2}, 4: {0, 1, 2}}) == [3, 4]
    assert cut({0: {3, 4}, 1: {3, 4}, 2: {3, 4}, 3: {0, 1, 2, 4}, 4: {0, 1, 2, 3}}) == [3, 4]
    # Two cut off, one by more: it goes first, then the other.
    assert cut({0: {4, 5}, 1: {4, 5}, 2: {4, 5}, 3: {5}, 4: {0, 1, 2}, 5: {0, 1, 2, 3}}) == [5, 4]
    # A survivor lost since its hello keeps its say (it was true then), not its place.
    assert cut({0: {1}, 1: {0, 2}, 2: {1}}, lost={2}) == [1]
    # The lost back the living up, never outvote them: 0, alive, says nothing of 1.
    assert cut({0: {2, 3}, 1: {2, 3}, 2: {1}, 3: {1}}, lost={2, 3}) == []
    # Lost while we rejoined: one survivor's later word against another's earlier hello,
    # a rank just taken back that one survivor's earlier hello still calls gone, one
    # survivor's word against another's, or one survivor saying others left: nobody.
    assert cut({0: set(), 1: set(), 2: {1}}, lost={1}) == []
    assert cut({1: {2}, 2: set(), 3: set()}) == []
    assert cut({0: {1}, 1: {0}}) == []
    assert cut({1: {2, 3}, 2: set(), 3: set()}) == []


async def test_a_rejoiner_sides_with_the_survivors_on_a_rank_they_dropped() -> None:
    """Rank 1 is cut off (its process lives on and still answers dials) and the others
    drop it; then rank 3 restarts. Rank 1 answers rank 3's dial as a survivor, but the
    survivors say it left: rank 3 must count it as left too, or the two sides disagree
    on the members (a collective or a choice of leader would then split them)."""
    async with groups(4, config=LEAVE) as gs:
        crash(gs[1])
        await until_left([gs[0], gs[2], gs[3]], 1)
        crash(gs[3])
        await until_left([gs[0], gs[2]], 3)
        back = await restart(gs[3])
        async with back:
            assert sorted(back.left) == [1], back.left
            await wait_until(lambda: 3 not in gs[0].left and 3 not in gs[2].left, "3 is back")
            assert sorted(gs[0].left) == sorted(gs[2].left) == [1]
            x = np.arange(4.0)
            got = await asyncio.gather(back.send(x, 0), gs[0].recv(3, like=x))
            np.testing.assert_array_equal(got[1], x)
            with pytest.raises(P2PError, match="rank 1"):  # as to any rank gone
                await back.send(x, 1)


async def test_two_ranks_cut_off_at_once_are_both_left_to_a_rejoiner() -> None:
    async with groups(5, config=LEAVE) as gs:
        crash(gs[3])  # both cut off from everyone, their processes live on
        crash(gs[4])
        await until_left(gs[:3], 3)
        await until_left(gs[:3], 4)
        crash(gs[2])
        await until_left(gs[:2], 2)
        back = await restart(gs[2])
        async with back:
            assert sorted(back.left) == sorted(gs[0].left) == sorted(gs[1].left) == [3, 4]


async def test_a_lower_rank_restarting_while_another_rejoins_is_dialed_again() -> None:
    """Rank 3 rejoins; rank 1 answers it, then crashes and restarts (rejoin=True) while
    3 is still rejoining (rank 2's answer held back). Rank 1 is lower, so it keeps 3's
    dial and waits for it; 3's reach for it had ended, so 3 dials it again (it used to
    leave the new rank 1 waiting until its start() timed out)."""
    async with groups(4, config=LEAVE) as gs:
        crash(gs[3])
        await until_left(gs[:3], 3)
        release = hold_take_back(gs[2], 3)
        back = await restart(gs[3])
        starting = asyncio.create_task(back.start())
        try:
            await wait_until(lambda: 0 in back._conns and 1 in back._conns, "0 and 1 answer")
            old = back._conns[1]
            crash(gs[1])
            await until_left([gs[0], gs[2]], 1)
            await wait_until(lambda: old.closed, "the old rank 1 gone for the rejoiner")
            new1 = await restart(gs[1], dataclasses.replace(gs[1].config, connect_timeout=10.0))
            new1_starting = asyncio.create_task(new1.start())
            await asyncio.sleep(1.0)  # the new rank 1 dials 0, 2 and 3 while 3 rejoins
            release.set()
            await asyncio.wait_for(starting, 20)
            await asyncio.wait_for(new1_starting, 20)
            assert sorted(back.left) == sorted(new1.left) == []
            x = np.arange(3.0)
            got = await asyncio.gather(back.send(x, 1), new1.recv(3, like=x))
            np.testing.assert_array_equal(got[1], x)
            await new1.close()
        finally:
            await back.close()


async def test_a_rank_lost_while_another_rejoins_is_not_mistaken_for_a_cut_off_one() -> None:
    """Rank 1 answers the rejoiner, then dies; rank 2 answers after seeing it go. One
    survivor's later word against another's earlier hello drops nobody wrongly: the
    rejoiner ends with rank 1 left (its connection ends too), never crashes."""
    async with groups(4, config=LEAVE) as gs:
        crash(gs[3])
        await until_left([gs[0], gs[1], gs[2]], 3)
        take_back = gs[2]._take_back

        async def late(rank: int, conn: Any) -> None:  # rank 2 answers last
            await wait_until(lambda: 3 not in gs[1].left, "rank 1 took 3 back")
            await asyncio.sleep(0.2)  # rank 1's hello is on its way
            crash(gs[1])
            await until_left([gs[2]], 1)
            await take_back(rank, conn)

        gs[2]._take_back = late  # type: ignore[method-assign]
        back = await restart(gs[3])
        async with back:
            await wait_until(lambda: 1 in back.left, "rank 1's loss seen by the rejoiner")
            assert 2 not in back.left and 0 not in back.left


async def test_a_restarted_rank_rejoins_and_full_collectives_run_again() -> None:
    async with groups(3, config=LEAVE) as gs:
        for _ in range(3):
            await asyncio.gather(*(g.all_reduce(np.ones(4)) for g in gs))
        x = np.arange(3.0)
        await gs[0].send(x, 2)
        await gs[2].recv(0, like=x)
        sub = (await asyncio.gather(*(g.split(0) for g in gs)))[0]
        crash(gs[2])
        await until_left(gs[:2], 2)
        back = await restart(gs[2])
        async with back:
            assert back.rejoined and not back.left
            for g in gs[:2]:
                assert not g.left and g.broken is None
            everyone = (*gs[:2], back)
            out = await asyncio.gather(*(g.all_reduce(np.full(4, g.rank + 1.0)) for g in everyone))
            assert all(o.tolist() == [6.0] * 4 for o in out)
            await gs[0].send(x + 1, 2)  # point to point counts start again for the new process
            np.testing.assert_array_equal(await back.recv(0, like=x), x + 1)
            await back.send(x + 2, 1)
            np.testing.assert_array_equal(await gs[1].recv(2, like=x), x + 2)
            assert sub is not None and 2 in sub.left  # a sub-group made before keeps it out


async def test_a_rank_rejoining_learns_who_else_is_gone() -> None:
    async with groups(4, config=LEAVE) as gs:
        crash(gs[3])
        crash(gs[2])
        await until_left(gs[:2], 3)
        await until_left(gs[:2], 2)
        await gs[3].close()
        back = await restart(gs[2])
        async with back:
            assert back.left.keys() == {3} and "rejoined" in str(back.left[3])
            assert all(g.left.keys() == {3} for g in gs[:2])
            y = np.ones(2)
            await back.send(y, 0)
            np.testing.assert_array_equal(await gs[0].recv(2, like=y), y)


async def test_rejoining_a_group_that_does_not_take_ranks_back_is_refused() -> None:
    from p2pdist import PeerAuthenticationError

    with pytest.raises(UsageError, match="on_peer_loss"):
        Group.from_seed(
            "s" * 20, rank=0, world=2, peers=["127.0.0.1:1", "127.0.0.1:2"], rejoin=True
        )
    async with groups(2, timeout=5.0) as gs:
        crash(gs[1])
        config = GroupConfig(
            connect_timeout=5.0, on_peer_loss="leave", transport=gs[1].config.transport
        )
        back = await restart(gs[1], config=config)
        with pytest.raises(PeerAuthenticationError, match=r"rank 0 .*on_peer_loss"):
            await back.start()


async def test_a_broken_group_refuses_a_rejoin_at_once_saying_why() -> None:
    """Survivors whose group is broken turn a rejoiner away with the reason (it used to
    be taken back, and its first collective waited out its timeout blaming rank 0)."""
    from p2pdist import PeerAuthenticationError

    async with groups(3, config=LEAVE, timeout=10.0) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        gs[0]._break(GroupBrokenError("a test broke it"), notify=True)
        await wait_broken(gs[1])
        back = await restart(gs[2])
        with pytest.raises(PeerAuthenticationError, match=r"the group is broken .*a test broke it"):
            await asyncio.wait_for(back.start(), 5)
        await back.close()


async def test_a_rejoin_with_another_seed_is_told_to_check_the_seed() -> None:
    from p2pdist import PeerAuthenticationError

    async with groups(3, config=LEAVE, timeout=10.0) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        await gs[2].close()
        other = rejoiner(gs[2], seed="another-seed-0123456789")
        with pytest.raises(PeerAuthenticationError, match="same seed") as info:
            await asyncio.wait_for(other.start(), 5)
        assert "on_peer_loss" not in str(info.value)  # the hint for another refusal
        await other.close()


async def test_rejoin_true_against_a_group_still_forming_says_so_at_once() -> None:
    """A rank started with rejoin=True while the others are still forming hears their
    formation 'ok' and fails at once saying why (it waited out connect_timeout, blaming
    ranks it was connected to)."""
    from group_helpers import loopback_peers

    peers = loopback_peers(3)
    cfg = GroupConfig(connect_timeout=20.0, on_peer_loss="leave")
    forming = [
        Group.from_seed("test-seed-0123456789", rank=r, world=3, peers=peers, config=cfg)
        for r in (0, 1)
    ]
    late = Group.from_seed(
        "test-seed-0123456789", rank=2, world=3, peers=peers, config=cfg, rejoin=True
    )
    starts = [asyncio.ensure_future(g.start()) for g in forming]
    try:
        with pytest.raises(UsageError, match=r"still forming the group"):
            await asyncio.wait_for(late.start(), 5)
    finally:
        for t in starts:
            t.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        await asyncio.gather(*(g.close() for g in (*forming, late)))


async def test_a_rank_that_leaves_while_another_rejoins_is_not_waited_for() -> None:
    """Rank 2 rejoins; rank 0 takes it back (its hello says nobody is gone), then rank 1
    closes while rank 2's dial to it is still on its way (slowed here). Rank 0 tells the
    rejoiner, which stops waiting for rank 1 (it used to redial it until connect_timeout
    and fail the whole rejoin)."""
    from dataclasses import replace

    async with groups(3, config=LEAVE, timeout=10.0) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        back = await restart(gs[2], config=replace(gs[2].config, connect_timeout=20.0))
        dial = back._dial

        async def slow_dial(transport: Any, r: int) -> Any:
            if r == 1:
                await asyncio.sleep(1.0)  # a slower path to rank 1
            return await dial(transport, r)

        back._dial = slow_dial  # type: ignore[method-assign]
        start = asyncio.create_task(back.start())
        await wait_until(lambda: 2 not in gs[0].left, "rank 0 taking rank 2 back")
        await gs[1].close()
        await asyncio.wait_for(start, 8)
        assert sorted(back.left) == [1]
        got = await asyncio.gather(gs[0].send(np.arange(3.0), 2), back.recv(0, timeout=5))
        assert got[1].tolist() == [0.0, 1.0, 2.0]
        await back.close()


async def wait_broken(g: Group) -> None:
    await wait_until(lambda: g.broken is not None, "the abort notice")


async def test_a_rank_restarted_without_rejoin_is_refused_at_once_and_stays_left() -> None:
    """A restarted rank that forgot ``rejoin=True`` dials to form a group: the survivors
    refuse it with the fix (well within connect_timeout, 20 s) and keep it as left; the
    same rank restarted with ``rejoin=True`` is then taken back."""
    from p2pdist import PeerAuthenticationError

    async with groups(3, config=LEAVE) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        await gs[2].close()
        assert gs[2]._addresses is not None
        plain = Group.from_seed(
            "test-seed-0123456789", rank=2, world=3, peers=gs[2]._addresses, config=gs[2].config
        )
        with pytest.raises(PeerAuthenticationError, match=r"rank [01] .*rejoin=True"):
            await asyncio.wait_for(plain.start(), 10)
        await asyncio.sleep(0.2)  # room for a wrong take-back to show
        assert all(2 in g.left for g in gs[:2]), [sorted(g.left) for g in gs[:2]]
        back = await restart(gs[2])
        async with back:
            assert all(not g.left for g in gs[:2])
            out = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in (*gs[:2], back)))
            assert all(o.tolist() == [3.0, 3.0] for o in out)


async def test_a_rank_rejoining_with_other_settings_is_refused_naming_them() -> None:
    """A restarted rank whose chunk_bytes differs from the group's is refused with
    MismatchError naming the setting, stays left, and is taken back once restarted with
    the group's settings."""
    from dataclasses import replace

    from p2pdist import MismatchError

    async with groups(3, config=LEAVE) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        odd = await restart(gs[2], config=replace(gs[2].config, chunk_bytes=4 << 20))
        with pytest.raises(MismatchError, match=r"chunk_bytes is 4194304 on rank 2 \("):
            await asyncio.wait_for(odd.start(), 10)
        await odd.close()
        assert all(2 in g.left for g in gs[:2])
        back = await restart(gs[2])
        async with back:
            out = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in (*gs[:2], back)))
            assert all(o.tolist() == [3.0, 3.0] for o in out)


async def test_a_rank_rejoins_through_a_relay(tmp_path: Path) -> None:
    from relay_helpers import RelayProcess

    from p2pdist import PunchConfig

    seed = "relay-elastic-seed-0123456789"
    cfg = GroupConfig(
        timeout=30.0, connect_timeout=30.0, punch=PunchConfig(enabled=False), on_peer_loss="leave"
    )
    with RelayProcess(tmp_path) as relay:
        gs = [Group.from_seed(seed, rank=r, world=3, relay=relay.url, config=cfg) for r in range(3)]
        await asyncio.gather(*(g.start() for g in gs))
        back: Group | None = None
        try:
            crash(gs[2])  # its QUIC connections close at once (a SIGKILL: idle_timeout)
            await until_left(gs[:2], 2)
            await gs[2].close()
            back = Group.from_seed(seed, rank=2, world=3, relay=relay.url, config=cfg, rejoin=True)
            await back.start()
            everyone = (gs[0], gs[1], back)
            out = await asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in everyone))
            assert all(o.tolist() == [6.0] * 3 for o in out)
        finally:
            await asyncio.gather(*(g.close() for g in (*gs, *([back] if back else []))))


async def a_call_failed_by_the_loss_of_rank_2(gs: list[Group]) -> None:
    """Rank 0 starts an all_reduce, then rank 2 is lost: the loss fails rank 0's call."""
    call = asyncio.create_task(gs[0].all_reduce(np.ones(4)))
    await until_running(gs[0])
    crash(gs[2])
    await until_left(gs[:2], 2)
    with pytest.raises(ConnectionBrokenError, match=r"rank 2 \("):
        await call


async def test_ranks_stay_in_step_when_one_started_the_call_a_loss_failed_and_one_refused_it() -> (
    None
):
    async with groups(3, config=LEAVE, timeout=15.0) as gs:
        # rank 0 starts an all_reduce before rank 2 is lost (the loss fails it); rank 1
        # calls it only after seeing the loss (refused at once). Both used the call up:
        # once rank 2 is back, the three run the next collective together.
        await a_call_failed_by_the_loss_of_rank_2(gs)
        with pytest.raises(GroupBrokenError, match=r"rank 2 \(.*left the group"):
            await gs[1].all_reduce(np.ones(4))
        assert gs[0]._next_cid == gs[1]._next_cid
        gs[0]._on_call_failed(0, 2, None, 1)  # rank 1's notice for the call rank 0 already ended
        assert not gs[0]._failed_calls  # is not kept
        back = await restart(gs[2])
        async with back:
            everyone = (*gs[:2], back)
            out = await asyncio.gather(*(g.all_reduce(np.full(4, g.rank + 1.0)) for g in everyone))
            assert all(o.tolist() == [6.0] * 4 for o in out)


async def test_ranks_stay_in_step_when_the_lost_rank_is_back_before_one_calls() -> None:
    """Rank 0's all_reduce fails for rank 2's loss; rank 2 restarts and rejoins before
    rank 1 gets to the same call. Rank 1 must still fail that call (rank 0 told it), not
    run it with the rejoiner (which, like rank 0, is at the next one): before, the three
    ran different calls until the timeout broke the group on every rank."""
    async with groups(3, config=LEAVE, timeout=15.0) as gs:
        await a_call_failed_by_the_loss_of_rank_2(gs)
        back = await restart(gs[2])
        async with back:
            assert not gs[1].left  # it is back before rank 1 calls
            with pytest.raises(ConnectionBrokenError, match=r"rank 2 \(.*left the group"):
                await asyncio.wait_for(gs[1].all_reduce(np.ones(4)), 5)
            everyone = (*gs[:2], back)
            out = await asyncio.wait_for(
                asyncio.gather(*(g.all_reduce(np.full(4, g.rank + 1.0)) for g in everyone)), 10
            )
            assert all(o.tolist() == [6.0] * 4 for o in out)
            assert all(g.broken is None for g in everyone)


async def until_back(gs: list[Group], rank: int) -> None:
    await wait_until(lambda: all(rank not in g.left for g in gs), f"rank {rank} back", 20)


async def fail_at_once_then_run_together(
    gs: list[Group], back: Group, rank0_call: Awaitable[Any]
) -> None:
    """Once rank 2 (``back``) is back: rank 0's call and rank 1's part of it fail at
    once naming rank 2, far below the timeout, and the next call runs on all three."""
    await until_back(gs[:2], 2)
    results = await asyncio.wait_for(
        asyncio.gather(rank0_call, gs[1].all_reduce(np.ones(2)), return_exceptions=True), 10
    )
    for r in results:
        assert isinstance(r, ConnectionBrokenError) and "rank 2 (" in str(r), r
    everyone = (*gs[:2], back)
    out = await asyncio.wait_for(
        asyncio.gather(*(g.all_reduce(np.full(2, g.rank + 1.0)) for g in everyone)), 10
    )
    assert all(o.tolist() == [6.0, 6.0] for o in out)
    assert all(g.broken is None for g in everyone)


async def test_a_call_running_when_a_rank_that_said_goodbye_rejoins_fails_at_once() -> None:
    """Rank 0 is in an all_reduce (rank 1 is slow to join it) when rank 2 closes (a
    goodbye, which fails no running call) and is restarted with rejoin=True. Rank 0's
    call then read rank 2's part from the new process's connection, for a call it never
    runs: the timeout, then the group broken on every rank (an audit). Taking the rank
    back now fails the running call naming it and tells the others; the next call runs
    on all three."""
    async with groups(3, config=LEAVE, timeout=20.0) as gs:
        await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        running = asyncio.create_task(gs[0].all_reduce(np.ones(2)))
        await until_running(gs[0])
        await gs[2].close()
        await until_left(gs[:2], 2)
        back = await restart(gs[2])
        async with back:
            await fail_at_once_then_run_together(gs, back, running)


async def test_a_call_made_before_a_rejoin_and_started_after_it_fails_everywhere_at_once() -> None:
    """Rank 0 makes a call while rank 2 is gone and starts it after rank 2 is back: it
    failed on rank 0 only, telling nobody, so rank 1's part waited out the timeout and
    the group broke on every rank (an audit). Rank 1 is told now."""
    async with groups(3, config=LEAVE, timeout=20.0) as gs:
        await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        crash(gs[2])
        await until_left(gs[:2], 2)
        made = gs[0].all_reduce(np.ones(2))  # its id is taken now; it runs later
        back = await restart(gs[2])
        async with back:
            await fail_at_once_then_run_together(gs, back, made)


async def silently_gone_then_back(gs: list[Group]) -> Group:
    """Rank 2 dies silently (its listener closes, and the others' connections to it look
    silent: nothing reaches them) and its new process, made with rejoin=True, is
    returned to be started."""
    listener = gs[2]._transport._server  # type: ignore[union-attr]
    assert listener is not None
    await listener.close()
    for g in gs[:2]:
        g._conns[2].idle_for = lambda: 1e9  # type: ignore[method-assign]
    return rejoiner(gs[2])


async def test_a_recv_cut_by_a_silent_ranks_rejoin_leaves_the_new_messages_in_order() -> None:
    """Rank 0 waits in recv(2) when rank 2 dies silently (nothing reaches rank 0) and
    restarts with rejoin=True. The recv, cut by the rejoin, gave its message number back
    after the new process's numbers were reset: rank 0 then read the new messages as
    3, 0, 1, 2 (wrong data, same shapes) and waited for a 4th (an audit)."""
    async with groups(3, config=LEAVE, timeout=20.0, keepalive_interval=0.2) as gs:
        x = np.zeros(3)
        for i in range(3):
            await asyncio.gather(gs[2].send(x + i, 0), gs[0].recv(2, like=x))
        waiting = asyncio.create_task(gs[0].recv(2, like=x, timeout=30))
        await asyncio.sleep(0.1)
        back = await silently_gone_then_back(gs)
        async with back:
            with pytest.raises(ConnectionBrokenError, match="connected again"):
                await asyncio.wait_for(waiting, 10)
            for k in range(4):
                await back.send(x + 10 + k, 0)
            got = [float((await gs[0].recv(2, like=x, timeout=10))[0]) for _ in range(4)]
            assert got == [10.0, 11.0, 12.0, 13.0]
        crash(gs[2])


async def test_a_subgroup_call_that_has_the_rejoiners_part_still_finishes() -> None:
    """Taking a rank back failed the running calls of every group with it, sub-groups
    too, though a sub-group keeps the old connection and had the rank's part there:
    rank 0 failed a call ranks 1 and 2 had finished (a reviewer). Only the root group's
    calls fail now."""
    async with groups(3, config=LEAVE, timeout=20.0) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None for s in subs)
        with slow_link(gs[1], 0, 3.0, space=subs[1]._space):  # rank 1 -> 0 comes late
            calls = [asyncio.create_task(s.all_reduce(np.ones(2))) for s in subs]  # type: ignore[union-attr]
            await until_running(gs[0])
            for call in calls[1:]:
                assert (await asyncio.wait_for(call, 5)).tolist() == [3.0, 3.0]
            old = [g._conns[2] for g in gs[:2]]
            back = await restart(gs[2])  # a goodbye, then a new process
            async with back:
                await wait_until(
                    lambda: all(g._conns[2] is not o for g, o in zip(gs[:2], old, strict=True)),
                    "rank 2 taken back",
                )
                out = await asyncio.wait_for(calls[0], 10)  # rank 2's part is in the old one
                assert out.tolist() == [3.0, 3.0]


async def test_a_rank_back_before_its_loss_was_seen_is_told_of_no_old_call() -> None:
    """Rank 2 dies silently during a call and restarts before ranks 0 and 1 notice: the
    call failed twice over, and its CancelledError told the members again after the
    rank was taken back, the new process included, which never ran it (a reviewer). One
    notice now, to the old members only."""
    async with groups(3, config=LEAVE, timeout=20.0, keepalive_interval=0.2) as gs:
        await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        sent: list[tuple[dict[str, Any], list[int]]] = []
        send_control = gs[0]._send_control

        def spy(body: dict[str, Any], ranks: Any) -> None:
            ranks = list(ranks)
            sent.append((dict(body), ranks))
            send_control(body, ranks)

        gs[0]._send_control = spy  # type: ignore[method-assign]
        calls = [asyncio.create_task(g.all_reduce(np.ones(2))) for g in gs[:2]]
        for g in gs[:2]:
            await until_running(g)
        back = await silently_gone_then_back(gs)
        async with back:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            assert all(isinstance(r, ConnectionBrokenError) for r in results), results
            await asyncio.sleep(0.3)  # what the failed calls would still send
            notices = [(b, r) for b, r in sent if "call" in b]
            assert notices == [({"call": 1, "lost": 2}, [1])], notices
            assert not back._failed_calls
        crash(gs[2])


async def test_a_caller_cancelling_a_collective_a_loss_also_failed_still_gets_cancelled() -> None:
    async with groups(3, config=LEAVE) as gs:
        call = asyncio.create_task(gs[0].all_reduce(np.ones(4)))
        await until_running(gs[0])
        gs[0]._cancel_for_loss(call, 2)  # as rank 2's loss would
        call.cancel()  # and the caller gives up at the same moment
        with pytest.raises(asyncio.CancelledError):
            await call


@pytest.mark.parametrize("death", ["kill", "stop"])
async def test_a_rank_that_dies_silently_rejoins_through_a_relay_at_once(
    tmp_path: Path, death: str
) -> None:
    """Rank 2 (a process of its own) is SIGKILLed, or SIGSTOPped, and restarted with
    rejoin=True at once. Stopped, its relay session stays open and nothing tells the
    survivors: they still hold the old QUIC connection (idle_timeout 30 s). The relay
    gives the id to the new process's session, the survivors take it back once the old
    connection has been silent for 3 keepalive intervals, and the next collective runs
    with all three."""
    import signal
    import sys

    from rejoin_worker import SEED, config
    from relay_helpers import RelayProcess

    worker = str(Path(__file__).with_name("rejoin_worker.py"))

    async def rank2(mode: str, url: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, worker, mode, url, stdout=asyncio.subprocess.PIPE
        )

    with RelayProcess(tmp_path) as relay:
        gs = [
            Group.from_seed(SEED, rank=r, world=3, relay=relay.url, config=config()) for r in (0, 1)
        ]
        old = await rank2("first", relay.url)
        back: asyncio.subprocess.Process | None = None
        try:
            await asyncio.wait_for(asyncio.gather(*(g.start() for g in gs)), 30)
            firsts = await asyncio.wait_for(
                asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in gs)), 30
            )
            assert all(o.tolist() == [6.0] * 3 for o in firsts)
            assert old.stdout is not None
            line = await asyncio.wait_for(old.stdout.readline(), 30)
            assert line.strip() == b"READY", line
            dead = [g._conns[2] for g in gs]
            old.send_signal(signal.SIGKILL if death == "kill" else signal.SIGSTOP)
            back = await rank2("back", relay.url)
            for _ in range(3000):  # bounded: until both survivors hold the new connection
                if all(g._conns.get(2) not in (None, d) for g, d in zip(gs, dead, strict=True)):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail(
                    f"the survivors did not take rank 2's new connection within 30 s: "
                    f"{[g._conns.get(2) for g in gs]}"
                )
            assert all(2 not in g.left for g in gs), [g.left for g in gs]
            outs = await asyncio.wait_for(
                asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in gs)), 30
            )
            assert all(o.tolist() == [6.0] * 3 for o in outs), outs
            out, _ = await asyncio.wait_for(back.communicate(), 30)
            assert out.strip() == b"SUM 6 6 6", out
        finally:
            for proc in (old, back):
                if proc is not None and proc.returncode is None:
                    proc.kill()
                    await asyncio.wait_for(proc.wait(), 10)
            await asyncio.gather(*(g.close() for g in gs))


def ends_on_rejoin(survivor: Group, how: str) -> None:
    """Make ``survivor`` end after a rejoining rank's dial reached it and before its
    hello: it "dies" (every socket, its listener too), "closes" on purpose, or "is
    closing" already when the dial comes."""
    take_back = survivor._take_back

    async def ends(rank: int, conn: Any) -> None:
        if how == "is closing":
            closing = asyncio.ensure_future(survivor.close())
            await asyncio.sleep(0)
            await take_back(rank, conn)
            await closing
        elif how == "closes":
            await asyncio.sleep(0.3)
            await survivor.close()
        else:
            await asyncio.sleep(0.3)
            crash(survivor)
            conn._transport.abort()  # the rejoiner's connection goes with it
            assert survivor._transport is not None
            await survivor._transport.close()  # and its listener: a dead process

    survivor._take_back = ends  # type: ignore[method-assign]


@pytest.mark.parametrize("how", ["dies", "closes", "is closing"])
async def test_a_survivor_that_ends_while_a_rank_rejoins_does_not_fail_the_rejoin(
    how: str,
) -> None:
    """Rank 2 rejoins; rank 1 ends after rank 2's dial reached it and before its hello:
    it dies (every socket, its listener too), closes on purpose, or was closing already
    when the dial came. Rank 2 dials it again, rank 0 reports it gone, and the rejoin
    ends with rank 1 left (each raised at once from start(): "connection lost", "closed
    its connection (left)", and a refusal saying the group was broken and every rank
    must restart, though only rank 1 closed: an audit)."""
    async with groups(3, config=LEAVE) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        ends_on_rejoin(gs[1], how)
        await gs[2].close()
        back = rejoiner(gs[2])
        try:
            await asyncio.wait_for(back.start(), 30)
            assert sorted(back.left) == [1], back.left
            assert sorted(gs[0].left) == [1], gs[0].left  # rank 2 is back there
            with pytest.raises(ConnectionBrokenError, match=r"rank 1 \(.*had left"):
                await back.send(np.ones(3), 1, timeout=3)
            with pytest.raises(ConnectionBrokenError, match=r"rank 1 \(.*had left"):
                await back.recv(1, timeout=3)  # (both were a bare KeyError: an audit)
            outs = await asyncio.wait_for(
                asyncio.gather(back.send(np.ones(2), 0), gs[0].recv(2)), 10
            )
            assert outs[1].tolist() == [1.0, 1.0]
        finally:
            await back.close()


@pytest.mark.parametrize("how", ["closes", "is closing"])
async def test_the_only_survivor_closing_while_a_rank_rejoins_fails_the_rejoin_at_once(
    how: str,
) -> None:
    """World 2: rank 1 rejoins and rank 0, the only survivor, closes on purpose after
    the dial reached it and before its hello (or was closing already). No other rank can
    report it gone and no rank is left to rejoin: start() fails at once, naming rank 0
    and saying it closed (it dialed rank 0 again until its connect_timeout ran out: a
    note left from an earlier session)."""
    async with groups(2, config=LEAVE, timeout=5) as gs:
        crash(gs[1])
        await until_left(gs[:1], 1)
        ends_on_rejoin(gs[0], how)
        await gs[1].close()
        back = rejoiner(gs[1])
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(ConnectionBrokenError, match=r"rank 0 \(.*closed") as info:
                await asyncio.wait_for(back.start(), 30)
            assert asyncio.get_running_loop().time() - started < 10, info.value
            assert "no other rank" in str(info.value), info.value
        finally:
            await back.close()


async def test_a_rejoin_closed_while_it_starts_says_so() -> None:
    """close() while start() rejoins: start() raises GroupBrokenError "the group was
    closed while it started", as a forming start does (it raised the bare "connection ...
    was closed locally": an audit)."""
    async with groups(3, config=LEAVE) as gs:
        crash(gs[2])
        await until_left(gs[:2], 2)
        release = hold_take_back(gs[1])
        await gs[2].close()
        back = rejoiner(gs[2])
        starting = asyncio.create_task(back.start())
        await asyncio.sleep(1.0)  # rank 1 holds its answer
        await back.close()
        with pytest.raises(GroupBrokenError, match="the group was closed while it started"):
            await asyncio.wait_for(starting, 10)
        release.set()
