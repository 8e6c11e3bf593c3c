"""Decentralised federated averaging over a real Group (TCP on 127.0.0.1): every rank
ends with the same bits, a late rank blocks nobody, and its late frame of round k
reaches neither round k + 1 nor a later all-reduce."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import Group, GroupBrokenError, MismatchError, UsageError
from p2pdist.federated import FederatedConfig, GroupAveraging, GroupRound, aggregate
from p2pdist.federated.messages import UPDATE, encode, round_channel
from p2pdist.wire.frames import FrameLimits

F32 = np.dtype(np.float32)


def update_of(rank: int, rnd: int, n: int = 1000) -> np.ndarray:
    return np.random.default_rng([rank, rnd]).standard_normal(n).astype(np.float32)


async def test_every_rank_ends_with_bit_identical_models() -> None:
    cfg = FederatedConfig(round_timeout=10.0)
    async with groups(4) as gs:
        model = np.zeros(1000, np.float32)
        feds = [GroupAveraging(g, model + g.rank, cfg, leader=1) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        assert len({f.model.tobytes() for f in feds}) == 1  # the leader's model won
        start = feds[0].model.copy()
        for rnd in range(3):
            outs = await asyncio.gather(
                *(f.step(update_of(f.group.rank, rnd), 10 + f.group.rank) for f in feds)
            )
            assert all(o.applied and o.included and o.reason == "complete" for o in outs)
            assert {o.participants for o in outs} == {(0, 1, 2, 3)}
            assert len({o.aggregate.tobytes() for o in outs if o.aggregate is not None}) == 1
        assert len({f.model.tobytes() for f in feds}) == 1
        # guard: the updates differ, so agreement is not trivial, and the result is
        # the sample-weighted mean
        assert not np.array_equal(update_of(0, 0), update_of(1, 0))
        want = start.astype(np.float64)
        for rnd in range(3):
            ups = [update_of(r, rnd).astype(np.float64) for r in range(4)]
            want += sum((10 + r) * u for r, u in enumerate(ups)) / sum(10 + r for r in range(4))
        np.testing.assert_allclose(feds[0].model, want, rtol=1e-5, atol=1e-5)
        assert all(f.round == 3 for f in feds)


async def _late_rank_scenario(max_staleness: int) -> tuple[list[GroupRound], list[Group], int]:
    """Rank 2 sends its round-0 update after round 0 closed, then all run round 1."""
    cfg = FederatedConfig(round_timeout=1.0, max_staleness=max_staleness)
    round0_done = asyncio.Event()
    results: list[GroupRound] = []
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(1000, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))

        async def rank(f: GroupAveraging) -> GroupRound:
            r = f.group.rank
            if r == 2:
                await round0_done.wait()  # round 0 has closed without us
            first = await f.step(update_of(r, 0), 10)
            if r == 0:
                round0_done.set()
            assert first.round == 0 and first.participants == (0, 1)
            assert first.included == (r != 2)
            fresh = update_of(r, 1) if r != 2 else None  # rank 2 resends what it carries
            return await f.step(fresh, 10)

        results = list(await asyncio.gather(*(rank(f) for f in feds)))
        dropped = sum(gs[r].connection(2).stats.dropped_stale for r in (0, 1))
        # a later collective on the same group sees none of it
        sums = await asyncio.gather(*(g.all_reduce(np.full(5, g.rank + 1.0)) for g in gs))
        for s in sums:
            np.testing.assert_array_equal(s, np.full(5, 6.0))
        assert len({f.model.tobytes() for f in feds}) == 1
    return results, gs, dropped


async def test_late_frame_of_round_k_is_dropped_and_never_reaches_round_k_plus_1() -> None:
    results, _, dropped = await _late_rank_scenario(max_staleness=0)
    assert dropped == 2  # rank 2's round-0 update reached ranks 0 and 1 after the round
    for out in results:
        assert out.round == 1 and out.participants == (0, 1) and out.applied
        want = aggregate([update_of(0, 1), update_of(1, 1)], [10.0, 10.0], "mean", 0.2, F32)
        assert out.aggregate is not None and out.aggregate.tobytes() == want.tobytes()


async def test_late_update_within_max_staleness_rolls_into_the_next_round_discounted() -> None:
    results, _, dropped = await _late_rank_scenario(max_staleness=1)
    assert dropped == 2
    w = 10 * 2**-0.5
    want = aggregate(
        [update_of(0, 1), update_of(1, 1), update_of(2, 0)], [10.0, 10.0, w], "mean", 0.2, F32
    )
    for out in results:
        assert out.participants == (0, 1, 2) and out.stale == 1
        assert out.aggregate is not None and out.aggregate.tobytes() == want.tobytes()
    assert results[2].included and not results[2].carried


async def test_nan_from_one_rank_is_rejected_and_that_rank_is_told() -> None:
    cfg = FederatedConfig(round_timeout=0.5)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        bad = np.full(10, np.nan, np.float32)
        outs = await asyncio.gather(
            *(f.step(bad if f.group.rank == 2 else np.ones(10, np.float32), 1) for f in feds)
        )
        for o in outs:
            assert o.participants == (0, 1) and o.rejected == {"nonfinite": 1}
        assert outs[2].own_reason == "nonfinite" and not outs[2].carried
        assert len({f.model.tobytes() for f in feds}) == 1


async def test_a_rank_with_no_update_holds_no_round_to_its_deadline() -> None:
    """A rank that calls step(None) with nothing carried (it trained nothing this
    round) says so: the round closes complete once the others are in, not at its 60 s
    deadline; a leader with nothing says so too (it is rank 0 here), and the rank that
    abstained is not named in the round but applies it like the others."""
    cfg = FederatedConfig(round_timeout=60.0)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        for idle in (2, 0):  # a follower, then the leader
            steps = [
                f.step(None) if f.group.rank == idle else f.step(np.full(10, f.group.rank, F32), 1)
                for f in feds
            ]
            outs = await asyncio.wait_for(asyncio.gather(*steps), 20)
            busy = tuple(r for r in range(3) if r != idle)
            for o in outs:
                assert o.reason == "complete" and o.participants == busy
            assert not outs[idle].included and not outs[idle].carried
            assert outs[idle].own_reason == ""
        assert len({f.model.tobytes() for f in feds}) == 1
        np.testing.assert_array_equal(feds[0].model, np.full(10, 0.5 + 1.5, np.float32))


async def test_a_rank_that_leaves_between_rounds_blocks_nobody() -> None:
    cfg = FederatedConfig(round_timeout=60.0)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        await asyncio.gather(*(f.step(np.ones(10, np.float32), 1) for f in feds))
        await feds[2].close()
        await gs[2].close()  # leaves on purpose
        outs = await asyncio.wait_for(
            asyncio.gather(*(f.step(np.ones(10, np.float32), 1) for f in feds[:2])), 30
        )
        assert all(o.reason == "complete" and o.participants == (0, 1) for o in outs)


async def test_an_update_sent_again_after_it_was_aggregated_is_refused_and_not_carried() -> None:
    cfg = FederatedConfig(round_timeout=0.5, max_staleness=2)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        await asyncio.gather(*(f.step(update_of(f.group.rank, 0, 10), 10) for f in feds))

        async def round1(f: GroupAveraging) -> GroupRound:
            if f.group.rank == 2:  # its round-0 update again, aggregated in round 0
                return await f.step(update_of(2, 0, 10), 10, base_round=0)
            return await f.step(update_of(f.group.rank, 1, 10), 10)

        outs = await asyncio.gather(*(round1(f) for f in feds))
        for o in outs:
            assert o.participants == (0, 1) and o.dropped == {"duplicate": 1}
        assert outs[2].own_reason == "duplicate" and not outs[2].carried
        out = await asyncio.gather(*(f.step(None) for f in feds[2:]), feds[0].step(None))
        assert out[0].own_reason == "" and not out[0].included  # nothing was sent again
        assert len({f.model.tobytes() for f in feds[:2]}) == 1


async def test_a_flood_of_bad_updates_from_one_rank_keeps_the_decision_small() -> None:
    # 9000 refusals of one rank, each listed, would make the decision too big to send
    cfg = FederatedConfig(round_timeout=30.0)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg, decision_timeout=10) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        meta, payload = encode("update", {"r": 0, "b": 0, "n": 1}, np.zeros(1, np.float32))
        for _ in range(9000):  # the wrong shape, to the leader only
            gs[2].connection(0).send_nowait(round_channel(0, 0, UPDATE), payload, meta=meta)
        outs = await asyncio.gather(*(f.step(update_of(f.group.rank, 0, 10), 10) for f in feds))
        for o in outs:
            assert o.participants == (0, 1, 2) and o.rejected == {"shape": 9000}
        assert outs[2].own_reason == "shape"
        assert all(f._last is not None and f._last["refused"] == [(2, "shape")] for f in feds)
        assert len({f.model.tobytes() for f in feds}) == 1


async def test_malformed_updates_in_a_loop_log_one_warning_per_rank_and_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = FederatedConfig(round_timeout=30.0)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg, decision_timeout=10) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        meta, payload = encode("update", {"r": 7, "b": 0, "n": 1}, np.zeros(10, np.float32))
        for _ in range(500):  # not an update for round 0: malformed, to the leader only
            gs[2].connection(0).send_nowait(round_channel(0, 0, UPDATE), payload, meta=meta)
        with caplog.at_level(logging.DEBUG, logger="p2pdist.federated.decentral"):
            outs = await asyncio.gather(*(f.step(update_of(f.group.rank, 0, 10), 10) for f in feds))
        assert all(o.participants == (0, 1, 2) for o in outs)
        malformed = [r for r in caplog.records if "ignored a malformed update" in r.message]
        assert len(malformed) == 500
        assert [r.levelno for r in malformed].count(logging.WARNING) == 1


async def test_a_decision_too_big_to_send_fails_the_leaders_step_loudly() -> None:
    cfg = FederatedConfig(round_timeout=30.0)
    async with groups(3, limits=FrameLimits(max_meta=150)) as gs:  # a decision is ~200
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        followers = [asyncio.create_task(f.step(np.ones(10, np.float32), 1)) for f in feds[1:]]
        with pytest.raises(UsageError, match=r"rank 0 \(.*decision of round 0 is \d+ bytes"):
            await feds[0].step(np.ones(10, np.float32), 1)
        with pytest.raises(GroupBrokenError, match="out of step"):
            await feds[0].step(None)
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)


@pytest.mark.parametrize("other", ["values", "shape", "dtype"])
async def test_a_rank_sending_different_updates_to_leader_and_follower_is_named(
    other: str,
) -> None:
    cfg = FederatedConfig(round_timeout=30.0)
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        honest = update_of(2, 0, 10)
        forged = {
            "values": honest + 1,
            "shape": np.zeros(5, np.float32),
            "dtype": honest.view(np.int32),  # the same bytes, read as other numbers
        }[other]
        for r, u in ((1, forged), (0, honest)):  # rank 2 plays it by hand, the leader last
            meta, payload = encode("update", {"r": 0, "b": 0, "n": 10}, u)
            gs[2].connection(r).send_nowait(round_channel(0, 0, UPDATE), payload, meta=meta)
        lead, follow = await asyncio.gather(
            *(f.step(update_of(f.group.rank, 0, 10), 10) for f in feds[:2]),
            return_exceptions=True,
        )
        assert isinstance(lead, GroupRound) and lead.participants == (0, 1, 2)
        assert isinstance(follow, MismatchError), follow
        assert follow.peer == gs[1].peer_label(2) and "round 0" in str(follow)
        with pytest.raises(GroupBrokenError, match=r"out of step.*rank 2"):
            await feds[1].step(None)


async def test_the_model_is_read_only_so_training_it_in_place_fails_at_once() -> None:
    # `delta = train(fed.model) - fed.model` with an in-place train() gave zero deltas
    # and ranks with different models, silently; now the write itself fails.
    async with groups(2) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), FederatedConfig()) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        for f in feds:
            with pytest.raises(ValueError, match="read-only"):
                f.model[:] -= 1.0
            assert not f.model.flags.writeable
        outs = await asyncio.gather(*(f.step(np.ones(10, np.float32), 1) for f in feds))
        assert all(o.applied for o in outs)
        assert all(not f.model.flags.writeable for f in feds)  # still, after a round
        for f in feds:
            np.testing.assert_array_equal(f.model, np.ones(10, np.float32))


async def test_updates_carried_by_a_missed_quorum_and_replaced_are_not_called_slow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rounds that miss their quorum apply nothing and carry every rank's update; a rank
    that then steps with a fresh update replaces its carried one, which is counted, but
    is no sign of slowness: nobody was late (it was warned that this rank "is slower
    than round_timeout": an audit)."""
    cfg = FederatedConfig(round_timeout=0.3, quorum=3)  # two ranks: never met
    async with groups(2) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        with caplog.at_level(logging.WARNING, logger="p2pdist.federated.decentral"):
            for k in range(3):
                outs = await asyncio.gather(
                    *(f.step(update_of(f.group.rank, k, 10), 10) for f in feds)
                )
                assert all(not o.applied and o.carried for o in outs), outs
        assert [f.carried_replaced for f in feds] == [2, 2]
        assert not [r for r in caplog.records if "no round aggregated" in r.getMessage()]


async def test_a_carried_update_replaced_unaggregated_is_warned_about_once_per_10_rounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A rank slower than round_timeout whose every fresh step(delta) replaces the update
    # it carries never contributes; it is told so (rate-limited), on that rank.
    cfg = FederatedConfig(round_timeout=0.5)
    done = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
    async with groups(3) as gs:
        feds = [GroupAveraging(g, np.zeros(10, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))

        async def rank(f: GroupAveraging) -> list[GroupRound]:
            r, outs = f.group.rank, []
            for k in range(4):
                if r == 2 and k < 3:
                    await done[k].wait()  # round k has closed without us
                outs.append(await f.step(update_of(r, k, 10), 10))
                if r == 0 and k < 3:
                    done[k].set()
            return outs

        with caplog.at_level(logging.WARNING, logger="p2pdist.federated.decentral"):
            outs = await asyncio.gather(*(rank(f) for f in feds))
        assert [o.carried for o in outs[2]] == [True, True, True, False]
        assert outs[2][3].included  # in time at last, with its fourth update
        assert feds[2].carried_replaced == 3 and feds[0].carried_replaced == 0
        warned = [r.getMessage() for r in caplog.records if "no round aggregated" in r.message]
        # the first replacement is quiet (a rank that joined or rejoined misses the round
        # it came back in: that is no slowness); the second, in the next round, is said;
        # the third, a round later, is not (one warning per 10 rounds)
        assert len(warned) == 1, warned
        assert warned[0].startswith("rank 2: round 2: ") and "aggregated, again" in warned[0]
        assert "await fed.step(None)" in warned[0] and "round_timeout (0.5 s)" in warned[0]


async def test_a_follower_waits_for_a_decision_the_leader_makes_at_the_deadline() -> None:
    """Rank 2 never steps, so the leader decides at the round's deadline (1.5 s), later
    than the group's 1 s timeout: the follower waits for the round, then for
    decision_timeout (it used to fail after decision_timeout alone, its update counted,
    and stayed out of step for good)."""
    async with groups(3, timeout=1.0) as gs:
        cfg = FederatedConfig(round_timeout=1.5)
        feds = [GroupAveraging(g, np.zeros(4, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        got = await asyncio.gather(*(f.step(np.ones(4, np.float32), 1) for f in feds[:2]))
        assert [o.reason for o in got] == ["deadline", "deadline"]
        assert all(o.participants == (0, 1) for o in got)
        np.testing.assert_array_equal(feds[0].model, feds[1].model)


def test_a_complex_model_is_refused_with_the_reason() -> None:
    """The norm bound, the mean and the robust rules work on real values (a complex
    model lost its imaginary parts there, or crashed the mean)."""
    from p2pdist.federated import Coordinator

    with pytest.raises(UsageError, match=r"real numeric array.*real and imaginary parts"):
        Coordinator(np.zeros(3, np.complex64))


async def test_a_bad_step_argument_is_a_usage_error_that_leaves_the_rank_in_step() -> None:
    """A numpy count is taken as the int it is; a missing or bad count is refused before
    anything is sent (a numpy count used to break the rank for good, and the default
    count of 0 had every update rejected)."""
    async with groups(2) as gs:
        feds = [GroupAveraging(g, np.zeros(4, np.float32), FederatedConfig()) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        for bad in ((), (0,), (2.5,)):
            with pytest.raises(UsageError, match="num_samples"):
                await feds[0].step(np.ones(4, np.float32), *bad)
        with pytest.raises(UsageError, match="base_round"):
            await feds[0].step(np.ones(4, np.float32), 1, base_round=-1)
        # From a model not made yet: it was sent, refused as too stale, carried, resent
        # every round and counted at full weight once the rounds got there (an audit).
        with pytest.raises(UsageError, match="base_round 3 is after the round now open"):
            await feds[0].step(np.ones(4, np.float32), 1, base_round=3)
        for big in ({"num_samples": 2**70}, {"base_round": 2**70}):  # msgpack cannot send it
            args: dict[str, Any] = {"num_samples": 1, **big}
            with pytest.raises(UsageError, match=next(iter(big))):  # it broke the rank
                await feds[0].step(np.ones(4, np.float32), **args)
        outs = await asyncio.gather(
            *(f.step(np.full(4, f.group.rank + 1.0, np.float32), np.int64(1)) for f in feds)
        )
        assert all(o.applied and o.participants == (0, 1) for o in outs)
        assert feds[0].model.tolist() == feds[1].model.tolist() == [1.5] * 4
        await asyncio.gather(*(f.close() for f in feds))


async def test_an_update_too_stale_to_send_says_so() -> None:
    """An update whose base is past max_staleness already is dropped on the rank without
    being sent; its round said nothing of it (own_reason "", only local_drops counted)."""
    cfg = FederatedConfig(max_staleness=1, round_timeout=1.0)  # its round waits it out
    async with groups(2) as gs:
        feds = [GroupAveraging(g, np.zeros(4, np.float32), cfg) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        for _ in range(2):
            await asyncio.gather(*(f.step(np.ones(4, np.float32), 1) for f in feds))
        outs = await asyncio.gather(
            feds[0].step(np.ones(4, np.float32), 1),
            feds[1].step(np.ones(4, np.float32), 1, base_round=0),  # round 2: 2 > 1 stale
        )
        assert outs[1].own_reason == "too_stale" and not outs[1].carried
        assert not outs[1].included and feds[1].local_drops == 1
        assert outs[0].own_reason == "" and outs[0].included
        await asyncio.gather(*(f.close() for f in feds))


async def test_a_refused_instance_holds_no_tag_and_bad_arguments_are_usage_errors() -> None:
    """A GroupAveraging refused for its model (or config, leader, decision timeout) kept
    its tag reserved for the group's life; a dict config or a string leader failed later
    with AttributeError/TypeError."""
    async with groups(2) as gs:
        g = gs[0]
        bad: list[tuple[dict[str, Any], str]] = [
            ({"model": np.zeros(3, np.complex64)}, "real numeric array"),
            ({"config": {"rule": "mean"}}, "config must be a FederatedConfig"),
            ({"leader": "0"}, "leader must be a rank"),
            ({"decision_timeout": -1.0}, "decision_timeout"),
        ]
        for kwargs, message in bad:
            args: dict[str, Any] = {"model": np.zeros(3, np.float32), **kwargs}
            with pytest.raises(UsageError, match=message):
                GroupAveraging(g, **args)
        fed = GroupAveraging(g, np.zeros(3, np.float32), leader=np.int64(0))
        assert fed.leader == 0 and type(fed.leader) is int


async def test_a_second_step_while_one_runs_is_refused() -> None:
    """Two step() calls at once on the leader both returned round 0 and the next round
    failed on an AssertionError inside the leader."""
    async with groups(2) as gs:
        feds = [GroupAveraging(g, np.zeros(4, np.float32), FederatedConfig()) for g in gs]
        await asyncio.gather(*(f.start() for f in feds))
        first = asyncio.create_task(feds[0].step(np.ones(4, np.float32), 1))
        await asyncio.sleep(0)
        with pytest.raises(UsageError, match="already running"):
            await feds[0].step(np.ones(4, np.float32), 1)
        other = await feds[1].step(np.ones(4, np.float32), 1)
        assert (await first).round == other.round == 0
        outs = await asyncio.gather(*(f.step(np.ones(4, np.float32), 1) for f in feds))
        assert all(o.round == 1 and o.applied for o in outs)
        await asyncio.gather(*(f.close() for f in feds))
