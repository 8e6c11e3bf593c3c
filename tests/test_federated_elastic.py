"""Decentralised averaging when ranks are lost (GroupConfig(on_peer_loss="leave")): the
round closes with the survivors, who agree bit for bit; updates delivered before a rank
died are still read; a missing update, a lost leader and the default mode fail naming
the rank. In-process groups over real TCP sockets ("crash": sockets dropped without a
goodbye), and real processes killed with SIGKILL (tests/elastic_worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from group_helpers import groups, loopback_peers
from test_group_elastic import crash, restart, until_left

from p2pdist import ConnectionBrokenError, Group, GroupBrokenError, UsageError
from p2pdist.federated import FederatedConfig, GroupAveraging, GroupRound, aggregate
from p2pdist.federated.messages import encode, round_channel
from p2pdist.transport.base import Connection

F32 = np.dtype(np.float32)
LEAVE = {"on_peer_loss": "leave"}
WORKER = Path(__file__).with_name("elastic_worker.py")


def update_of(rank: int, rnd: int, n: int = 1000) -> np.ndarray:
    return np.random.default_rng([rank, rnd]).standard_normal(n).astype(np.float32)


CFG = FederatedConfig(round_timeout=60.0)


@contextlib.asynccontextmanager
async def averaging(
    world: int,
    size: int,
    *,
    config: dict[str, Any] = LEAVE,
    timeout: float = 20.0,
    cfg: FederatedConfig = CFG,
    first_round: bool = False,
    **kw: Any,
) -> AsyncIterator[tuple[list[Group], list[GroupAveraging]]]:
    """``world`` groups (``config``: GroupConfig fields), each with a started
    GroupAveraging of a zero float32 model of ``size`` (``kw``: its other arguments),
    after round 0 with every rank if ``first_round``; their readers stop at the end."""
    async with groups(world, config=config, timeout=timeout) as gs:
        feds = [GroupAveraging(g, np.zeros(size, np.float32), cfg, **kw) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        if first_round:
            await _first_round(feds)
        try:
            yield gs, feds
        finally:
            await asyncio.gather(*(f.close() for f in feds))


async def _first_round(feds: list[GroupAveraging]) -> None:
    outs = await asyncio.gather(
        *(f.step(update_of(f.group.rank, 0, f.model.size), 10) for f in feds)
    )
    assert all(o.participants == tuple(range(len(feds))) for o in outs)


async def test_an_update_sent_before_a_crash_is_still_read_by_every_survivor() -> None:
    async with averaging(4, 1000, first_round=True) as (gs, feds):
        # rank 3 sends its round-1 update (to the leader last), then dies
        victim = asyncio.create_task(feds[3].step(update_of(3, 1), 13))
        await asyncio.sleep(0)
        crash(gs[3])
        victim.cancel()
        await until_left(gs[:3], 3)  # every survivor reads rank 3's update after that
        outs = await asyncio.gather(*(f.step(update_of(f.group.rank, 1), 10) for f in feds[:3]))
        want = aggregate([update_of(r, 1) for r in range(4)], [10.0] * 3 + [13.0], "mean", 0.2, F32)
        for o in outs:
            assert o.reason == "complete" and o.participants == (0, 1, 2, 3)
            assert o.left == (3,)
            assert o.aggregate is not None and o.aggregate.tobytes() == want.tobytes()
        # the next rounds go on without it
        for rnd in (2, 3):
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, rnd), 10) for f in feds[:3])
            )
            assert all(o.participants == (0, 1, 2) and o.reason == "complete" for o in outs)
        assert len({f.model.tobytes() for f in feds[:3]}) == 1
        assert not np.array_equal(update_of(0, 2), update_of(1, 2))  # agreement is not trivial
        for g in gs[:3]:
            with pytest.raises(GroupBrokenError, match=r"rank 3 \(.*left the group"):
                await g.all_reduce(np.ones(2))


async def test_an_update_that_never_arrived_fails_naming_its_rank() -> None:
    async with averaging(3, 100) as (gs, feds):
        # rank 2's round-0 update reaches the leader only, then rank 2 dies
        meta, payload = encode("update", {"r": 0, "b": 0, "n": 5}, update_of(2, 0, 100))
        gs[2].connection(0).send_nowait(round_channel(0, 0, 0), payload, meta=meta)
        await asyncio.sleep(0.2)
        crash(gs[2])
        await until_left(gs[:2], 2)
        lead, follow = await asyncio.gather(
            *(f.step(update_of(f.group.rank, 0, 100), 10) for f in feds[:2]),
            return_exceptions=True,
        )
        assert not isinstance(lead, BaseException) and lead.participants == (0, 1, 2)
        assert isinstance(follow, ConnectionBrokenError), follow
        assert follow.peer.startswith("rank 2 (") and "never reached" in str(follow)
        with pytest.raises(GroupBrokenError, match=r"out of step.*rank 2"):
            await feds[1].step(None)


async def test_without_failover_a_lost_leader_fails_every_follower_naming_it() -> None:
    async with averaging(3, 10, failover=False) as (gs, feds):
        crash(gs[0])
        await until_left(gs[1:], 0)
        outs = await asyncio.gather(
            *(f.step(np.ones(10, np.float32), 1) for f in feds[1:]), return_exceptions=True
        )
        for o in outs:
            assert isinstance(o, ConnectionBrokenError), o
            assert o.peer.startswith("rank 0 (") and "leader" in str(o)


async def test_a_lost_leader_is_replaced_by_the_lowest_rank_left() -> None:
    async with averaging(4, 100, first_round=True) as (gs, feds):
        crash(gs[0])  # the leader, between rounds
        for rnd in (1, 2, 3):
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, rnd, 100), 10) for f in feds[1:])
            )
            want = aggregate(
                [update_of(r, rnd, 100) for r in (1, 2, 3)], [10.0] * 3, "mean", 0.2, F32
            )
            for o in outs:
                assert o.participants == (1, 2, 3) and o.left == (0,) and o.reason == "complete"
                assert o.aggregate is not None and o.aggregate.tobytes() == want.tobytes()
        assert all(f.leader == 1 for f in feds[1:]) and feds[1].is_leader
        assert len({f.model.tobytes() for f in feds[1:]}) == 1


async def test_a_rank_with_no_update_tells_the_new_leader_after_a_failover() -> None:
    """A rank with no update for the round (step(None), nothing carried) tells the
    leader so; when the leader is lost, it tells the new one in turn, and the round
    closes complete with the others, not at its 60 s deadline."""
    async with averaging(4, 100, first_round=True) as (gs, feds):
        crash(gs[0])  # the leader, between rounds
        steps = [f.step(update_of(f.group.rank, 1, 100), 10) for f in feds[1:3]]
        outs = await asyncio.wait_for(asyncio.gather(*steps, feds[3].step(None)), 20)
        for o in outs:
            assert o.participants == (1, 2) and o.reason == "complete" and o.left == (0,)
        assert not outs[2].included and feds[1].is_leader
        assert len({f.model.tobytes() for f in feds[1:]}) == 1


async def test_a_decision_one_rank_applied_is_adopted_by_the_new_leader() -> None:
    async with averaging(4, 100, first_round=True) as (gs, feds):
        send = feds[0]._send_decision
        # the leader's decision of round 1 reaches rank 2 only, then the leader dies
        feds[0]._send_decision = lambda k, body, ranks: send(k, body, [2] if k == 1 else ranks)  # type: ignore[method-assign]

        async def leader() -> list[GroupRound]:
            out = await feds[0].step(update_of(0, 1, 100), 10)
            crash(gs[0])
            return [out]

        async def follower(f: GroupAveraging) -> list[GroupRound]:
            first = await f.step(update_of(f.group.rank, 1, 100), 10)
            return [first, await f.step(update_of(f.group.rank, 2, 100), 10)]

        lead, *follows = await asyncio.gather(leader(), *(follower(f) for f in feds[1:]))
        decided = lead[0]
        assert decided.participants == (0, 1, 2, 3)
        for outs in follows:  # round 1 as the dead leader decided it, on every rank
            assert outs[0].participants == decided.participants
            assert outs[0].aggregate is not None and decided.aggregate is not None
            assert outs[0].aggregate.tobytes() == decided.aggregate.tobytes()
            assert outs[1].participants == (1, 2, 3) and outs[1].left == (0,)
        assert len({o[1].aggregate.tobytes() for o in follows if o[1].aggregate is not None}) == 1
        assert len({f.model.tobytes() for f in feds[1:]}) == 1


async def test_a_reader_of_updates_that_fails_fails_the_leaders_step_at_once() -> None:
    cfg = FederatedConfig(round_timeout=30.0)  # the bound on the wait without the check
    async with averaging(3, 10, cfg=cfg) as (_, feds):
        state = feds[0]._state
        assert state is not None

        def broken_submit(*args: object) -> None:
            raise RuntimeError("a bug in the state machine")

        state.submit = broken_submit  # type: ignore[method-assign]
        followers = [asyncio.create_task(f.step(np.ones(10, np.float32), 1)) for f in feds[1:]]
        with pytest.raises(RuntimeError, match="a bug in the state machine"):
            await feds[0].step(None)  # no update of its own: only the readers submit
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)


def test_a_takeover_adopts_what_was_applied_and_refuses_what_cannot_be() -> None:
    from p2pdist.federated.decision import Report
    from p2pdist.federated.failover import FailoverError, next_leader, plan_takeover

    d = {"r": 4, "ok": True}
    assert next_leader(4, {0, 1}) == 2
    with pytest.raises(FailoverError):
        next_leader(2, {0, 1})
    fresh = plan_takeover(1, Report(5, d), {2: Report(5, d), 3: Report(-1, None)})
    assert fresh.adopt is None and fresh.lead_from == 5 and fresh.rejoining == (3,)
    assert fresh.members == (1, 2)  # a rank that sent no report (gone, or not running) neither
    ahead = plan_takeover(1, Report(5, d), {2: Report(6, {"r": 5}), 3: Report(5, d)})
    assert ahead.adopt == {"r": 5} and ahead.behind == (1, 3) and ahead.lead_from == 6
    assert ahead.members == (1, 2, 3)
    mine = plan_takeover(1, Report(6, {"r": 5}), {2: Report(5, d)})
    assert mine.adopt == {"r": 5} and mine.behind == (2,) and mine.lead_from == 6
    with pytest.raises(FailoverError, match="more than one round"):
        plan_takeover(1, Report(5, d), {2: Report(7, {"r": 6})})
    with pytest.raises(FailoverError, match="rank 2 in round 6 did not say how round 5"):
        plan_takeover(1, Report(5, d), {2: Report(6, None), 3: Report(6, {"r": 5})})
    with pytest.raises(FailoverError, match="different decisions for round 5: rank 2, rank 3"):
        plan_takeover(1, Report(5, d), {2: Report(6, {"r": 5}), 3: Report(6, {"r": 5, "x": 1})})


def _decision(counted: object, r: int = 3) -> dict[str, Any]:
    """A decision of round ``r`` of a group of 4 with this ``counted`` field."""
    return {
        "r": r,
        "ok": True,
        "why": "complete",
        "p": [[1, r, 10, 10.0, bytes(16)]],
        "refused": [],
        "stale": 0,
        "dropped": {},
        "rejected": {},
        "cfg": ["mean", 0.2, 1.0],
        "left": [0],
        "counted": counted,
    }


@pytest.mark.parametrize(
    ("counted", "why"),
    [
        (None, "'counted' is not a list"),
        ({"1": 3}, "'counted' is not a list"),
        ([[r, 3] for r in range(5)], "'counted' names 5 ranks, the group has 4"),
        ([[1, 3, 0]], r"'counted' entry \[1, 3, 0\] is not \[rank, base_round\]"),
        ([[1, True]], r"'counted' entry \[1, True\] is not"),
        ([[1.0, 3]], r"'counted' entry \[1.0, 3\] is not"),
        ([[1, "3"]], r"'counted' entry \[1, '3'\] is not"),
        ([4], r"'counted' entry 4 is not"),
        ([[4, 3]], r"'counted' names rank 4, not in \[0, 4\)"),
        ([[-1, 3]], r"'counted' names rank -1"),
        ([[2, 3], [1, 3]], "'counted' ranks are not increasing at rank 1"),
        ([[1, 3], [1, 2]], "'counted' ranks are not increasing at rank 1"),
        ([[1, 4]], r"'counted' base round 4 of rank 1 is not in \[0, 3\]"),
        ([[1, -1]], r"'counted' base round -1 of rank 1"),
    ],
)
def test_what_a_decision_counted_is_checked_naming_the_leader(counted: object, why: str) -> None:
    from p2pdist import RemoteProtocolError
    from p2pdist.federated.decision import decision_body, report_of
    from p2pdist.federated.messages import Message

    with pytest.raises(RemoteProtocolError, match=why) as caught:
        decision_body(Message("decision", _decision(counted)), "rank 1 (abc)", 3, 4)
    assert caught.value.peer == "rank 1 (abc)"
    # the same checks on the last decision in a report to a new leader
    with pytest.raises(RemoteProtocolError, match=why):
        report_of(Message("report", {"r": 4, "last": _decision(counted)}), "rank 2 (d)", 4)
    missing = _decision([])
    del missing["counted"]
    with pytest.raises(RemoteProtocolError, match=r"malformed decision: KeyError.*counted"):
        decision_body(Message("decision", missing), "rank 1 (abc)", 3, 4)
    ok = decision_body(Message("decision", _decision([[1, 3], [3, 0]])), "rank 1 (abc)", 3, 4)
    assert ok["counted"] == [[1, 3], [3, 0]]
    assert ok["joining"] == []  # optional: an earlier version's leader sends none
    named = decision_body(Message("decision", {**_decision([]), "joining": [2]}), "l", 3, 4)
    assert named["joining"] == [2]


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("p", [[1, 3, 10, 10.0, bytes(16)]] * 2, "participant ranks .* are not distinct"),
        ("p", [[4, 3, 10, 10.0, bytes(16)]], r"participant ranks \[4\] are not distinct"),
        ("p", [[-1, 3, 10, 10.0, bytes(16)]], "participant ranks"),
        ("p", [[1, 4, 10, 10.0, bytes(16)]], "participant 1: base 4"),
        ("p", [[1, 3, -1, 10.0, bytes(16)]], "participant 1: base 3, samples -1"),
        ("p", [[1, 3, 10, float("nan"), bytes(16)]], "weight nan"),
        ("p", [[1, 3, 10, -1.0, bytes(16)]], "weight -1.0"),
        # no honest leader names these; all-zero weights failed later, naming nobody
        ("p", [[1, 3, 0, 10.0, bytes(16)]], "samples 0"),
        ("p", [[1, 3, 10, 0.0, bytes(16)]], "weight 0.0"),
        ("refused", [[2, "duplicate"], [2, "duplicate"]], "refused ranks"),
        ("refused", [[9, "duplicate"]], "refused ranks"),
        ("left", [0, 0], "left ranks"),
        ("left", [4], "left ranks"),
        ("joining", [2, 2], "joining ranks"),
        ("joining", [-1], "joining ranks"),
        ("joining", 3, "TypeError"),
    ],
)
def test_a_decision_naming_ranks_outside_the_group_or_twice_is_refused(
    field: str, value: object, why: str
) -> None:
    """Followers wait for each participant's update: a decision that names a rank twice
    or one outside the group would leave them waiting until the round's timeout."""
    from p2pdist import RemoteProtocolError
    from p2pdist.federated.decision import decision_body
    from p2pdist.federated.messages import Message

    bad = {**_decision([]), field: value}
    with pytest.raises(RemoteProtocolError, match="malformed decision: .*" + why) as caught:
        decision_body(Message("decision", bad), "rank 1 (abc)", 3, 4)
    assert caught.value.peer == "rank 1 (abc)"


async def test_an_update_resent_to_the_new_leader_after_a_failover_counts_once() -> None:
    # the leader is lost between rounds; rank 3 sends its round-0 update, aggregated in
    # round 0 by the old leader, again in round 1: the new leader refuses it too
    cfg = FederatedConfig(round_timeout=2.0, max_staleness=2)
    async with averaging(4, 100, cfg=cfg, first_round=True) as (gs, feds):
        crash(gs[0])

        async def round1(f: GroupAveraging) -> GroupRound:
            if f.group.rank == 3:
                return await f.step(update_of(3, 0, 100), 10, base_round=0)
            return await f.step(update_of(f.group.rank, 1, 100), 10)

        outs = await asyncio.wait_for(asyncio.gather(*(round1(f) for f in feds[1:])), 30)
        want = aggregate([update_of(r, 1, 100) for r in (1, 2)], [10.0] * 2, "mean", 0.2, F32)
        for o in outs:
            assert o.participants == (1, 2) and o.dropped == {"duplicate": 1}, o
            assert o.aggregate is not None and o.aggregate.tobytes() == want.tobytes()
        assert outs[2].own_reason == "duplicate" and not outs[2].carried
        assert feds[1].is_leader and feds[1]._state is not None
        want_counted = {"000000": 0, "000001": 1, "000002": 1, "000003": 0}
        assert feds[1]._state.aggregated == want_counted
        assert len({f.model.tobytes() for f in feds[1:]}) == 1


async def test_a_new_leader_that_adopts_a_decision_remembers_what_it_counted() -> None:
    # the leader's decision of round 1 reaches rank 2 only, then the leader dies: the
    # new leader (rank 1, which never applied it) adopts it, and with it what it counted
    cfg = FederatedConfig(round_timeout=3.0, max_staleness=2)
    async with averaging(4, 100, cfg=cfg, first_round=True) as (gs, feds):
        send = feds[0]._send_decision
        feds[0]._send_decision = lambda k, body, ranks: send(k, body, [2] if k == 1 else ranks)  # type: ignore[method-assign]

        async def leader() -> GroupRound:
            out = await feds[0].step(update_of(0, 1, 100), 10)
            crash(gs[0])
            return out

        async def follower(f: GroupAveraging) -> list[GroupRound]:
            first = await f.step(update_of(f.group.rank, 1, 100), 10)
            if f.group.rank == 3:  # its round-1 update again, aggregated in round 1
                return [first, await f.step(update_of(3, 1, 100), 10, base_round=1)]
            return [first, await f.step(update_of(f.group.rank, 2, 100), 10)]

        lead, *follows = await asyncio.wait_for(
            asyncio.gather(leader(), *(follower(f) for f in feds[1:])), 30
        )
        assert lead.participants == (0, 1, 2, 3)
        for first, second in follows:
            assert first.participants == (0, 1, 2, 3)
            assert second.participants == (1, 2) and second.dropped == {"duplicate": 1}
        assert follows[2][1].own_reason == "duplicate" and not follows[2][1].carried
        assert feds[1].is_leader
        assert len({f.model.tobytes() for f in feds[1:]}) == 1


async def test_a_new_leader_after_a_round_that_applied_nothing_counts_its_updates_fresh() -> None:
    """Round 1 misses its quorum (rank 2 sends nothing: 2 of the 3 updates needed), so it
    applies nothing and the model stays round 1's; then the leader is lost. The new
    leader must count an update from round 1's model as fresh for round 2's quorum (it
    seeds its rounds with model_from = 1): the round closes by its quorum. (Unseeded,
    the resent update was not fresh, so the quorum of fresh updates was never met and
    the round closed only as "complete", once every member's part was in: with a
    member missing, it would have waited for its deadline.)"""
    cfg = FederatedConfig(round_timeout=5.0, policy="quorum", quorum=1.0, max_staleness=2)
    async with averaging(3, 100, cfg=cfg, first_round=True) as (gs, feds):

        async def round1(f: GroupAveraging) -> GroupRound:
            if f.group.rank == 2:
                return await f.step(None)
            return await f.step(update_of(f.group.rank, 1, 100), 10)

        outs = await asyncio.wait_for(asyncio.gather(*(round1(f) for f in feds)), 30)
        assert all(not o.applied for o in outs), outs
        crash(gs[0])

        async def round2(f: GroupAveraging) -> GroupRound:
            if f.group.rank == 1:  # its round-1 update again: the model is still round 1's
                return await f.step(update_of(1, 1, 100), 10, base_round=1)
            return await f.step(update_of(2, 2, 100), 10)

        loop = asyncio.get_running_loop()
        start = loop.time()
        outs = await asyncio.wait_for(asyncio.gather(*(round2(f) for f in feds[1:])), 30)
        took = loop.time() - start
        for o in outs:  # (staleness, for the discount, still counts rounds: 1 for rank 1)
            assert o.applied and o.reason == "quorum" and o.participants == (1, 2), o
        assert outs[0].aggregate is not None and outs[1].aggregate is not None
        assert outs[0].aggregate.tobytes() == outs[1].aggregate.tobytes()
        assert took < cfg.round_timeout  # closed by the quorum, not the deadline
        assert feds[1].is_leader


async def test_a_new_leader_after_two_rounds_that_applied_nothing_counts_their_base_fresh() -> None:
    """Rounds 1 and 2 both miss their quorum (rank 2 sends nothing), so the model is
    still round 1's; then the leader is lost. The decision carries since when the model
    is current (``since``), and the new leader counts rank 1's update from round 1 as
    fresh: round 3 closes by its quorum. (The successor took the model to be round 2's,
    one round back from its first: the update was stale for the quorum and the round
    closed only as "complete": an audit.)"""
    cfg = FederatedConfig(round_timeout=3.0, policy="quorum", quorum=1.0, max_staleness=3)
    async with averaging(3, 100, cfg=cfg, first_round=True) as (gs, feds):

        async def missed(f: GroupAveraging, k: int) -> GroupRound:
            if f.group.rank == 2:
                return await f.step(None)
            return await f.step(update_of(f.group.rank, 1, 100), 10, base_round=1)

        for k in (1, 2):
            outs = await asyncio.wait_for(asyncio.gather(*(missed(f, k) for f in feds)), 30)
            assert all(not o.applied for o in outs), (k, outs)
        crash(gs[0])

        async def round3(f: GroupAveraging) -> GroupRound:
            if f.group.rank == 1:  # its round-1 update again: the model is still round 1's
                return await f.step(update_of(1, 1, 100), 10, base_round=1)
            return await f.step(update_of(2, 3, 100), 10)

        outs = await asyncio.wait_for(asyncio.gather(*(round3(f) for f in feds[1:])), 30)
        for o in outs:
            assert o.applied and o.reason == "quorum" and o.participants == (1, 2), o
        assert feds[1].is_leader


async def test_by_default_a_crash_breaks_the_averaging_naming_the_lost_rank() -> None:
    async with averaging(3, 10, config={}) as (gs, feds):
        crash(gs[2])
        outs = await asyncio.gather(
            *(f.step(np.ones(10, np.float32), 1) for f in feds[:2]), return_exceptions=True
        )
        for o in outs:
            assert isinstance(o, GroupBrokenError | ConnectionBrokenError), o
            assert "rank 2 (" in str(o)


async def test_one_tag_per_group_and_its_sub_groups() -> None:
    async with groups(2) as gs:
        GroupAveraging(gs[0], np.zeros(3, np.float32), tag=5)
        with pytest.raises(UsageError, match=r"reserved by GroupAveraging\(tag=5\)"):
            GroupAveraging(gs[0], np.zeros(3, np.float32), tag=5)
        sub = (await asyncio.gather(*(g.split(0) for g in gs)))[0]
        assert sub is not None
        with pytest.raises(UsageError, match="already reserved"):
            GroupAveraging(sub, np.zeros(3, np.float32), tag=5)
        GroupAveraging(sub, np.zeros(3, np.float32), tag=6)


async def test_a_restarted_rank_gets_the_model_and_round_and_agrees_again() -> None:
    async with averaging(3, 100) as (gs, feds):
        await asyncio.gather(*(f.step(update_of(f.group.rank, 0, 100), 10) for f in feds))
        crash(gs[2])
        await until_left(gs[:2], 2)
        last: list[int] = []  # the round every rank stops after, once rank 2 is back in

        async def run(f: GroupAveraging) -> list[GroupRound]:
            outs = []
            give_up = asyncio.get_running_loop().time() + 60.0  # seconds, not rounds
            while not last or f.round <= last[0]:
                assert asyncio.get_running_loop().time() < give_up, "rank 2 was never taken back"
                out = await f.step(update_of(f.group.rank, f.round, 100), 10)
                outs.append(out)
                if 2 in out.participants and not last:
                    last.append(out.round + 1)
                await asyncio.sleep(0.01)
            return outs

        survivors = [asyncio.create_task(run(f)) for f in feds[:2]]
        back = await restart(gs[2])
        async with back:
            fed = GroupAveraging(back, np.full(100, 7.0, np.float32), CFG)
            await fed.start()  # the leader's model and round, at its next round
            welcomed = fed.round
            assert welcomed >= 2
            # the welcome's last decision carries what was aggregated (should it lead)
            assert fed._last is not None
            assert fed._last["counted"][:2] == [[0, welcomed - 1], [1, welcomed - 1]]
            mine = await run(fed)
            theirs = await asyncio.gather(*survivors)
            models = {f.model.tobytes() for f in (feds[0], feds[1], fed)}
            assert len(models) == 1  # the same bits again
            assert {f.round for f in (feds[0], feds[1], fed)} == {last[0] + 1}
            ends = [mine[-1], theirs[0][-1], theirs[1][-1]]
            assert len({(o.round, o.participants, o.left, o.reason) for o in ends}) == 1
            assert len({o.aggregate.tobytes() for o in ends if o.aggregate is not None}) == 1
            assert mine[-1].participants == (0, 1, 2) and mine[-1].left == ()
            gone = [o for o in theirs[0] if o.round < welcomed]
            assert gone and all(o.left == (2,) and 2 not in o.participants for o in gone)
            assert not np.array_equal(fed.model, np.full(100, 7.0, np.float32))


async def test_a_rank_waiting_to_be_taken_back_when_the_leader_dies_is_taken_by_the_next() -> None:
    async with averaging(4, 100, first_round=True) as (gs, feds):
        crash(gs[3])
        await until_left(gs[:3], 3)
        back = await restart(gs[3])
        async with back:
            fed = GroupAveraging(back, np.zeros(100, np.float32), CFG)
            waiting = asyncio.create_task(fed.start())  # asks every rank to take it back
            await asyncio.sleep(0.2)
            assert not waiting.done()  # nobody opened a round since
            crash(gs[0])  # the leader dies before taking it back
            await until_left(gs[1:3], 0)
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, 1, 100), 10) for f in feds[1:3])
            )
            for o in outs:  # the new leader asked rank 3, which said it is not in yet
                assert o.participants == (1, 2) and o.left == (0, 3)
            await waiting  # taken back by the new leader, when it opened round 2
            assert fed.round == 2 and fed.leader == 1
            assert fed.model.tobytes() == feds[1].model.tobytes()
            everyone = (feds[1], feds[2], fed)
            for rnd in (2, 3):  # round 2 does not wait for it, round 3 does
                outs = await asyncio.gather(
                    *(f.step(update_of(f.group.rank, rnd, 100), 10) for f in everyone)
                )
                assert len({(o.participants, o.left) for o in outs}) == 1
            assert outs[0].participants == (1, 2, 3) and outs[0].left == (0,)
            assert len({f.model.tobytes() for f in everyone}) == 1


@pytest.mark.parametrize("world, back_ranks", [(4, (1,)), (5, (1, 2))])
async def test_ranks_waiting_to_be_taken_back_decline_to_succeed_a_lost_leader(
    world: int, back_ranks: tuple[int, ...]
) -> None:
    # the restarted ranks, waiting to be taken back, are the lowest in the group when the
    # leader dies: the others pick them in turn, each declines (it has no model), and the
    # lowest survivor leads (none is asked twice: with two, they would take turns forever)
    survivors = [r for r in range(1, world) if r not in back_ranks]
    async with averaging(world, 100, timeout=30.0, first_round=True) as (gs, feds):
        for r in back_ranks:
            crash(gs[r])
            await until_left([g for g in gs if g.rank not in back_ranks], r)
        async with contextlib.AsyncExitStack() as stack:
            backs = [await stack.enter_async_context(await restart(gs[r])) for r in back_ranks]
            new = [GroupAveraging(b, np.zeros(100, np.float32), CFG) for b in backs]
            waiting = [asyncio.create_task(f.start()) for f in new]
            crash(gs[0])
            await until_left([gs[r] for r in survivors], 0)
            async with asyncio.timeout(60):  # a bound: choosing in circles never ends
                outs = await asyncio.gather(
                    *(feds[r].step(update_of(r, 1, 100), 10) for r in survivors)
                )
            for o in outs:
                assert o.participants == tuple(survivors) and o.left == (0, *back_ranks)
            assert all(feds[r].leader == survivors[0] for r in survivors)
            await asyncio.gather(*waiting)  # taken back by the new leader at round 2
            assert all(f.round == 2 and f.leader == survivors[0] for f in new)
            assert {f.model.tobytes() for f in new} == {feds[survivors[0]].model.tobytes()}
            everyone = [*(feds[r] for r in survivors), *new]
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, 2, 100), 10) for f in everyone)
            )
            assert len({(o.participants, o.left) for o in outs}) == 1
            assert len({f.model.tobytes() for f in everyone}) == 1


@pytest.mark.parametrize("back", [1, 3])
async def test_a_rank_back_in_the_group_before_its_averaging_starts_is_passed_over(
    back: int,
) -> None:
    # rank `back` restarted and is back in the group, but its application has not built
    # its GroupAveraging yet (nothing there reads the failover messages) when the leader
    # dies: the survivors neither choose it to lead (back=1, the lowest) nor wait for its
    # report (back=3), and take it back once it starts
    cfg = FederatedConfig(round_timeout=3.0)
    survivors = [r for r in (1, 2, 3) if r != back]
    async with averaging(4, 100, cfg=cfg, first_round=True, decision_timeout=3.0) as (gs, feds):
        crash(gs[back])
        await until_left([g for g in gs if g.rank != back], back)
        async with await restart(gs[back]) as restarted:
            crash(gs[0])
            await until_left([gs[r] for r in survivors], 0)
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with asyncio.timeout(30):
                outs = await asyncio.gather(
                    *(feds[r].step(update_of(r, 1, 100), 10) for r in survivors)
                )
            assert loop.time() - began < cfg.round_timeout  # nobody waited for it
            for o in outs:
                assert o.participants == tuple(survivors) and o.reason == "complete"
                assert o.left == tuple(sorted((0, back)))
            assert all(feds[r].leader == survivors[0] for r in survivors)
            # its averaging starts now: the new leader takes it back at a round it opens
            fed = GroupAveraging(restarted, np.zeros(100, np.float32), cfg, decision_timeout=3.0)
            waiting = asyncio.create_task(fed.start())
            await asyncio.sleep(0.2)  # its request reaches the leader during round 2
            await asyncio.gather(*(feds[r].step(update_of(r, 2, 100), 10) for r in survivors))
            await waiting
            assert fed.round == 3 and fed.leader == survivors[0]
            everyone = [*(feds[r] for r in survivors), fed]
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, 3, 100), 10) for f in everyone)
            )
            assert all(o.participants == (1, 2, 3) and o.left == (0,) for o in outs)
            # taken back, it counts again when the next leader is lost: the others (which
            # heard its request to be taken back) may choose it, and wait for its report
            crash(gs[survivors[0]])
            rest = [f for f in everyone if f.group.rank != survivors[0]]
            await until_left([f.group for f in rest], survivors[0])
            async with asyncio.timeout(30):
                outs = await asyncio.gather(
                    *(f.step(update_of(f.group.rank, 4, 100), 10) for f in rest)
                )
            ranks = tuple(sorted(f.group.rank for f in rest))
            assert all(o.participants == ranks and o.reason == "complete" for o in outs)
            assert all(f.leader == ranks[0] for f in rest)
            assert len({f.model.tobytes() for f in rest}) == 1


async def test_ranks_taken_back_together_agree_on_the_next_leader() -> None:
    # rank 1 restarts and asks to be taken back while rank 2 is still down, so rank 2
    # never hears that request; both are taken back at the same round, whose leader then
    # dies: rank 2 learns from its welcome that rank 1 is in the rounds, and every rank
    # chooses rank 1
    async with averaging(4, 100, first_round=True) as (gs, feds):
        crash(gs[1])
        crash(gs[2])
        await until_left([gs[0], gs[3]], 1)
        await until_left([gs[0], gs[3]], 2)
        async with contextlib.AsyncExitStack() as stack:
            back, waiting = [], []
            for r in (1, 2):  # one after the other: rank 2 comes back after rank 1 asked
                group = await stack.enter_async_context(await restart(gs[r]))
                back.append(GroupAveraging(group, np.zeros(100, np.float32), CFG))
                waiting.append(asyncio.create_task(back[-1].start()))
                await asyncio.sleep(0.2)  # its request to be taken back goes out
            assert not any(t.done() for t in waiting)
            for rnd in (1, 2):  # the leader reads both requests in round 2
                await asyncio.gather(*(feds[r].step(update_of(r, rnd, 100), 10) for r in (0, 3)))
            await asyncio.gather(*waiting)
            assert all(f.round == 3 for f in back)
            crash(gs[0])  # the leader, in the round both were taken back in
            everyone = [back[0], back[1], feds[3]]
            await until_left([f.group for f in everyone], 0)
            async with asyncio.timeout(30):
                outs = await asyncio.gather(
                    *(f.step(update_of(f.group.rank, 3, 100), 10) for f in everyone)
                )
            assert all(f.leader == 1 for f in everyone)
            assert len({(o.participants, o.left) for o in outs}) == 1
            assert outs[0].participants == (1, 2, 3)
            assert len({f.model.tobytes() for f in everyone}) == 1


async def test_a_rank_taken_back_after_one_that_never_heard_it_is_known_from_the_decision() -> None:
    # rank 1 asks to be taken back while rank 2 is down (so rank 2 never gets that
    # request), rank 2 asks next, and the leader reads rank 2's request first (rank 1's
    # is held back here, as a slower link would): rank 2 is taken back a round before
    # rank 1, so its welcome does not list rank 1. The decision that precedes rank 1's
    # welcome names it: when the leader then dies, rank 2 chooses rank 1 too
    async with averaging(4, 100, first_round=True) as (gs, feds):
        leader = feds[0]
        crash(gs[1])
        crash(gs[2])
        await until_left([gs[0], gs[3]], 1)
        await until_left([gs[0], gs[3]], 2)
        read_ready = leader._await_ready
        held = asyncio.Event()

        async def hold_rank_1(r: int, conn: Connection) -> None:
            if r == 1:
                await held.wait()
            await read_ready(r, conn)

        leader._await_ready = hold_rank_1  # type: ignore[method-assign]
        async with contextlib.AsyncExitStack() as stack:
            back: dict[int, GroupAveraging] = {}
            waiting: dict[int, asyncio.Task[None]] = {}
            for r in (1, 2):
                group = await stack.enter_async_context(await restart(gs[r]))
                back[r] = GroupAveraging(group, np.zeros(100, np.float32), CFG)
                waiting[r] = asyncio.create_task(back[r].start())
                await asyncio.sleep(0.2)  # its request to be taken back goes out
            for rnd in (1, 2):  # rank 2's request is read in round 2, welcomed at 3
                await asyncio.gather(*(feds[r].step(update_of(r, rnd, 100), 10) for r in (0, 3)))
            await waiting[2]
            assert back[2].round == 3 and not waiting[1].done()
            held.set()
            await asyncio.sleep(0.2)  # rank 1's request is read in round 3
            everyone = [leader, back[2], feds[3]]
            await asyncio.gather(*(f.step(update_of(f.group.rank, 3, 100), 10) for f in everyone))
            await waiting[1]  # welcomed at round 4
            assert back[1].round == 4 and back[2]._runs(1)
            crash(gs[0])
            everyone = [back[1], back[2], feds[3]]
            await until_left([f.group for f in everyone], 0)
            async with asyncio.timeout(30):
                outs = await asyncio.gather(
                    *(f.step(update_of(f.group.rank, 4, 100), 10) for f in everyone)
                )
            assert all(f.leader == 1 for f in everyone)
            assert all(o.participants == (1, 2, 3) for o in outs)
            assert len({f.model.tobytes() for f in everyone}) == 1


async def test_a_welcome_says_who_is_in_the_rounds_or_the_last_decision_does() -> None:
    from p2pdist import RemoteProtocolError
    from p2pdist.federated.messages import Message

    async with groups(2) as gs:
        fed = GroupAveraging(gs[1], np.zeros(3, np.float32))
        members = fed._welcome_members
        assert members(Message("welcome", {"in": [0, 1]}), "rank 0 (x)", 0) == [0, 1]
        for bad in (5, [2], [-1], [True], ["0"]):
            with pytest.raises(RemoteProtocolError, match="welcome: bad 'in'") as caught:
                members(Message("welcome", {"in": bad}), "rank 0 (x)", 0)
            assert caught.value.peer == "rank 0 (x)"
        # from a leader that sends no 'in': every rank before any decision, else the
        # ranks the last decision does not list as gone, and the leader
        assert members(Message("welcome", {}), "rank 0 (x)", 0) == [0, 1]
        fed._last = {"left": [1]}
        assert members(Message("welcome", {}), "rank 0 (x)", 0) == [0]


# ---- real processes, SIGKILL ------------------------------------------------------------


def run_world(mode: str, world: int, victim: int) -> dict[int, list[dict[str, object]]]:
    """Run ``world`` worker processes; ``victim`` SIGKILLs itself at the start of round 1
    (and, in mode "rejoin", is started again once dead). Returns the JSON lines of every
    survivor (and of the restarted victim)."""
    peers = ",".join(loopback_peers(world))

    def spawn(r: int, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(r), str(world), peers, str(victim), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = {r: spawn(r) for r in range(world)}
    lines: dict[int, list[dict[str, object]]] = {}
    try:
        out, err = procs[victim].communicate(timeout=120)
        assert procs[victim].returncode == -9, (procs[victim].returncode, err)
        if mode == "rejoin":
            procs[victim] = spawn(victim, "restarted")
        else:
            del procs[victim]
        for r, p in procs.items():
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            lines[r] = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
    return lines


def test_a_rank_killed_mid_round_leaves_and_the_survivors_agree() -> None:
    lines = run_world("leave", 4, victim=2)
    assert sorted(lines) == [0, 1, 3]
    rounds = {r: [x for x in ls if "round" in x] for r, ls in lines.items()}
    for rnd in range(4):
        seen = [rounds[r][rnd] for r in (0, 1, 3)]
        assert len({json.dumps(x, sort_keys=True) for x in seen}) == 1, seen  # same bits too
        x = seen[0]
        assert x["round"] == rnd and x["applied"]
        if rnd == 0:
            assert x["participants"] == [0, 1, 2, 3] and x["left"] == []
        else:  # closed as soon as the survivors were in, not at the 60 s deadline
            assert x["participants"] == [0, 1, 3] and x["left"] == [2]
            assert x["reason"] == "complete"
    assert len({rounds[r][3]["model"] for r in rounds}) == 1
    assert rounds[0][1]["model"] != rounds[0][2]["model"]  # the rounds changed the model
    for ls in lines.values():
        tail = ls[-1]
        assert tail["all_reduce"].startswith("GroupBrokenError"), tail  # type: ignore[union-attr]
        assert "rank 2 (" in tail["all_reduce"] and "left" in tail["all_reduce"]  # type: ignore[operator]


def test_a_killed_rank_breaks_the_averaging_by_default_naming_it() -> None:
    lines = run_world("break", 3, victim=2)
    for ls in lines.values():
        errors = [x["error"] for x in ls if "error" in x]
        assert len(errors) == 1 and "rank 2 (" in errors[0], ls  # type: ignore[operator]
        assert [x["round"] for x in ls if "round" in x] == [0]


def test_a_killed_leader_is_replaced_and_the_survivors_agree() -> None:
    lines = run_world("leave", 4, victim=0)
    assert sorted(lines) == [1, 2, 3]
    rounds = {r: [x for x in ls if "round" in x] for r, ls in lines.items()}
    for rnd in range(4):
        seen = [rounds[r][rnd] for r in (1, 2, 3)]
        assert len({json.dumps(x, sort_keys=True) for x in seen}) == 1, seen
        assert seen[0]["round"] == rnd and seen[0]["applied"]
        if rnd == 0:  # the leader died at the start of round 1
            assert seen[0]["participants"] == [0, 1, 2, 3] and seen[0]["left"] == []
        else:
            assert seen[0]["participants"] == [1, 2, 3] and seen[0]["left"] == [0]
            assert seen[0]["reason"] == "complete"
    assert all(not any("error" in x for x in ls) for ls in lines.values()), lines


def test_a_killed_rank_restarted_with_the_same_key_rejoins() -> None:
    lines = run_world("rejoin", 4, victim=2)
    assert sorted(lines) == [0, 1, 2, 3]
    assert all(not any("error" in x for x in ls) for ls in lines.values()), lines
    rounds = {r: {int(x["round"]): x for x in ls if "round" in x} for r, ls in lines.items()}  # type: ignore[call-overload]
    back = rounds[2]  # the restarted process: from the round it was taken back in
    assert min(back) > 1
    for rnd, x in back.items():  # every round it saw, it saw as the others did
        assert all(rounds[r][rnd] == x for r in (0, 1, 3)), (rnd, x)
    last = max(back)
    assert all(max(rounds[r]) == last for r in rounds)
    assert rounds[0][last]["participants"] == [0, 1, 2, 3] and rounds[0][last]["left"] == []
    assert rounds[0][1]["left"] == [2]
    for ls in lines.values():  # everyone is back: a full-group all_reduce runs again
        assert ls[-1] == {"all_reduce": "OK"}, ls[-1]
