"""Collective deadlines: one watchdog per group bounds every collective in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import Group, GroupBrokenError, PeerTimeoutError


async def test_short_timeout_after_long_bounded_calls_still_fires() -> None:
    # The watchdog is armed for the first call's 20 s bound; a later call bounded by
    # 0.5 s must not wait for that.
    async with groups(3, timeout=20.0) as gs:
        await asyncio.gather(*(g.all_reduce(np.ones(4)) for g in gs))
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(
            *(g.all_reduce(np.ones(4), timeout=0.5) for g in gs[:2]), return_exceptions=True
        )
        assert loop.time() - start < 10.0  # far below the 20 s default: not a timing test
        for res in results:
            assert isinstance(res, PeerTimeoutError), res
            assert "rank 2 (" in str(res)
            assert "timed out after 0.5 s" in str(res)
        with pytest.raises(GroupBrokenError):
            await gs[0].all_reduce(np.ones(4))


async def test_finished_calls_leave_nothing_to_expire() -> None:
    # Calls that finish long before their bound are never cancelled later.
    # One long-lived task per rank: a deadline left behind by a finished call would cancel
    # that task's later call (fresh tasks per call would hide it).
    async def rank_loop(g: Group) -> np.ndarray:
        for _ in range(3):
            await g.all_reduce(np.ones(4))
        await asyncio.sleep(2.5)  # past every bound given so far
        return await g.all_reduce(np.ones(4))

    async with groups(2, timeout=2.0) as gs:  # a loaded machine's stall stays below it
        outs = await asyncio.gather(*(rank_loop(g) for g in gs))
        assert [o.tolist() for o in outs] == [[2, 2, 2, 2]] * 2
        assert all(g.broken is None for g in gs)
        assert all(not g._inflight and not g._expired for g in gs)


async def test_sub_group_call_times_out_naming_the_absent_rank() -> None:
    async with groups(3, timeout=20.0) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None for s in subs)
        calls = [s.all_reduce(np.ones(2), timeout=0.5) for s in subs[:2] if s is not None]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for res in results:
            assert isinstance(res, PeerTimeoutError), res
            assert "rank 2 (" in str(res)


async def test_caller_cancellation_is_not_turned_into_a_timeout() -> None:
    async with groups(2, timeout=20.0) as gs:
        task = asyncio.create_task(gs[0].all_reduce(np.ones(4)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(gs[0].broken, GroupBrokenError)
        assert "was cancelled" in str(gs[0].broken)


async def crossed(
    made_0: tuple[Coroutine[Any, Any, Any], Coroutine[Any, Any, Any]],
    made_1: tuple[Coroutine[Any, Any, Any], Coroutine[Any, Any, Any]],
) -> list[Any]:
    """Rank 0 awaits the later of the two calls it made first, rank 1 the earlier: each
    waits in a call the other never starts. The call not awaited is closed; the results
    (or errors) of rank 0 and rank 1."""

    async def await_one(awaited: Coroutine[Any, Any, Any], left: Coroutine[Any, Any, Any]) -> None:
        try:
            await awaited
        finally:
            left.close()

    (first_0, second_0), (first_1, second_1) = made_0, made_1
    return await asyncio.gather(
        await_one(second_0, first_0), await_one(first_1, second_1), return_exceptions=True
    )


async def test_calls_awaited_out_of_the_order_they_were_made_are_named_in_the_timeout() -> None:
    """Both ranks make two calls in the same order; one awaits the later first. Each
    waits in a different call for ever: the timeout says that this rank holds an
    earlier call that never started, and how to run them instead."""
    async with groups(2, timeout=20.0) as (a, b):
        x = np.ones(4)

        results = await crossed(
            (a.all_reduce(x, timeout=0.5), a.all_reduce(x, timeout=0.5)),
            (b.all_reduce(x), b.all_reduce(x)),
        )
        first = results[0]
        assert isinstance(first, PeerTimeoutError), first
        me = b.peer_label(0)
        assert f"; {me} made 1 collective call(s) before it that have not started" in str(first)
        assert "start them as tasks" in str(first)
        assert isinstance(results[1], GroupBrokenError), results[1]  # told by rank 0
        assert f"; {me} made 1 collective" in str(results[1])


async def test_an_unstarted_call_on_the_parent_group_is_named_in_a_sub_groups_timeout() -> None:
    """Calls of a group and of its sub-group have ids of their own, but ranks still wait
    in them in the order they await them: the hint counts the parent's call too."""
    async with groups(2, timeout=20.0) as (a, b):
        sub_a, sub_b = await asyncio.gather(a.split(0), b.split(0))
        assert sub_a is not None and sub_b is not None
        x = np.ones(4)

        results = await crossed(
            (a.all_reduce(x), sub_a.all_reduce(x, timeout=0.5)),
            (b.all_reduce(x), sub_b.all_reduce(x)),
        )
        first = results[0]
        assert isinstance(first, PeerTimeoutError), first
        me = b.peer_label(0)
        assert (
            f"; {me} made 1 collective call(s) before it that have not started "
            "(1 of them on its parent group or a sub-group)"
        ) in str(first)
