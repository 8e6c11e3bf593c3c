"""GroupConfig(on_peer_loss="leave"): a lost rank counts as left and the group stays
usable without it; the default still breaks. Channel-space reservation. Real TCP sockets
on 127.0.0.1; a "crash" drops a rank's sockets without a goodbye, as a killed process
does (tests/test_federated_elastic.py kills real processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import ConnectionBrokenError, Group, GroupBrokenError, GroupConfig, UsageError
from p2pdist.group.core import _FIRST_RESERVED_SPACE

LEAVE = {"on_peer_loss": "leave"}


def crash(g: Group) -> None:
    """Drop every connection of ``g`` at once, without a goodbye (like SIGKILL)."""
    for conn in list(g._conns.values()):
        conn.abort(ConnectionBrokenError(g.peer_label(g.rank), "simulated crash"))  # type: ignore[attr-defined]


async def until_left(gs: list[Group], rank: int) -> None:
    """Wait (bounded) until every group in ``gs`` has seen ``rank`` go."""
    for _ in range(500):
        if all(rank in g.left for g in gs):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"rank {rank}'s loss was not seen: {[sorted(g.left) for g in gs]}")


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
        with pytest.raises(GroupBrokenError, match=r"rank 1 \(.*left the group"):
            await sub2.all_reduce(np.ones(3))


async def test_a_collective_in_flight_fails_naming_the_lost_rank_and_the_group_stays() -> None:
    async with groups(3, config=LEAVE, timeout=60.0) as gs:
        # ranks 0 and 1 start an all_reduce that rank 2 never joins; then rank 2 dies.
        # Rank 0 waits on rank 1 as much as on rank 2: both must fail, naming rank 2.
        calls = [asyncio.create_task(g.all_reduce(np.ones(1 << 18, np.float32))) for g in gs[:2]]
        await asyncio.sleep(0.2)
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
            g._next_space = _FIRST_RESERVED_SPACE - 4
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None and s._space == _FIRST_RESERVED_SPACE - 4 for s in subs)
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None and s._p2p_space == _FIRST_RESERVED_SPACE - 1 for s in subs)
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
