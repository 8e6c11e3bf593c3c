"""A collective takes its place in the call order when it is called (group/calls.py).

A call dropped before it ran on one rank (cancelled before its first step, never
awaited, refused while a later call was already made) leaves a gap there: the others'
matching call fails at once with MismatchError naming that rank, and every later call
still pairs with its own. Before, the dropped call took no id, and the next call paired
with the others' dropped one: wrong data, no error."""

from __future__ import annotations

import asyncio
import gc
import inspect
import sys
import threading
import warnings
from typing import Any
from unittest import mock

import numpy as np
import pytest
from group_helpers import crash, groups, loopback_peers, until_left
from test_group_elastic import restart

from p2pdist import (
    ConnectionBrokenError,
    Group,
    GroupBrokenError,
    GroupConfig,
    MismatchError,
    TransportConfig,
    UsageError,
)
from p2pdist.group.calls import CollectiveCall

# Generous: a call that is not told of the gap would fail with a timeout instead.
LONG = 30.0


async def in_step(gs: list[Group], step: int) -> None:
    """One more all_reduce on every rank; it must sum the arrays of this very step."""
    outs = await asyncio.gather(
        *(g.all_reduce(np.full(3, 10.0 * step + g.rank), timeout=LONG) for g in gs)
    )
    expected = sum(10.0 * step + r for r in range(len(gs)))
    for out in outs:
        np.testing.assert_array_equal(out, np.full(3, expected))


def cancelled_before_start(g: Group) -> asyncio.Task[np.ndarray]:
    task = asyncio.ensure_future(g.all_reduce(np.ones(3), timeout=LONG))
    task.cancel()  # before its first step
    return task


@pytest.mark.parametrize("world", [2, 3])
async def test_a_call_cancelled_before_it_ran_fails_the_others_and_keeps_the_order(
    world: int,
) -> None:
    async with groups(world) as gs:
        await in_step(gs, 1)
        skipped = cancelled_before_start(gs[0])
        with pytest.raises(asyncio.CancelledError):
            await skipped
        results = await asyncio.gather(
            *(g.all_reduce(np.ones(3), timeout=LONG) for g in gs[1:]), return_exceptions=True
        )
        for err in results:
            assert isinstance(err, MismatchError), err
            assert err.peer == gs[0].peer_label(0)
            assert "did not run all_reduce" in str(err)
            assert "cancelled before it started" in str(err)
        await in_step(gs, 2)  # the group goes on, in step
        await in_step(gs, 3)
        assert all(g.broken is None for g in gs)


async def test_the_others_told_before_they_start_fail_at_their_start() -> None:
    async with groups(2) as gs:
        a, b = gs
        skipped = cancelled_before_start(a)
        with pytest.raises(asyncio.CancelledError):
            await skipped
        await asyncio.sleep(0.2)  # the notice is in before b calls
        with pytest.raises(MismatchError, match="cancelled before it started"):
            await b.all_reduce(np.ones(3), timeout=LONG)
        await in_step(gs, 1)
        assert not a._failed_calls and not b._failed_calls


async def test_a_call_every_rank_drops_alike_keeps_them_in_step() -> None:
    # As a TaskGroup does on every rank when its body fails alike after create_task.
    async with groups(3) as gs:
        for _ in range(3):
            tasks = [cancelled_before_start(g) for g in gs]
            await asyncio.gather(*tasks, return_exceptions=True)
        await in_step(gs, 1)
        await asyncio.sleep(0.2)  # every rank's notices are in: all found the call past
        await in_step(gs, 2)
        assert all(not g._failed_calls and not g._pending for g in gs)


async def test_a_task_group_that_fails_on_one_rank() -> None:
    async with groups(2) as gs:
        a, b = gs

        async def rank_a() -> None:
            with pytest.raises(ExceptionGroup):
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(a.all_reduce(np.ones(3), timeout=LONG))
                    raise RuntimeError("only on rank 0")

        results = await asyncio.gather(
            rank_a(), b.all_reduce(np.ones(3), timeout=LONG), return_exceptions=True
        )
        assert results[0] is None
        assert isinstance(results[1], MismatchError), results[1]
        await in_step(gs, 1)


async def test_a_call_never_awaited_fails_the_others() -> None:
    async with groups(2) as gs:
        a, b = gs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "never awaited", as expected
            dropped = a.all_reduce(np.ones(3))
            assert isinstance(dropped, CollectiveCall)
            del dropped
            gc.collect()
        with pytest.raises(MismatchError, match="never awaited"):
            await b.all_reduce(np.ones(3), timeout=LONG)
        await in_step(gs, 1)


async def test_calls_pair_in_the_order_they_were_made_not_started() -> None:
    async with groups(2) as gs:
        a, b = gs
        first_a, second_a = a.all_reduce(np.full(2, 1.0)), a.all_reduce(np.full(2, 100.0))
        first_b, second_b = b.all_reduce(np.full(2, 2.0)), b.all_reduce(np.full(2, 200.0))
        # Rank 0 starts its second call first: it still meets rank 1's second.
        got = await asyncio.gather(second_a, first_a, first_b, second_b)
        for out, want in zip(got, [300.0, 3.0, 3.0, 300.0], strict=True):
            np.testing.assert_array_equal(out, [want, want])


async def test_a_refused_call_gives_its_id_back_unless_a_later_call_was_made() -> None:
    async with groups(2) as gs:
        a, b = gs
        # Refused alone: as if never called; the corrected call takes its place.
        with pytest.raises(UsageError, match="timeout"):
            await a.all_reduce(np.ones(3), timeout=0)
        await in_step(gs, 1)
        # Refused with a later call already made: the gap is told, the later call pairs.
        bad = a.all_reduce(np.ones(3), timeout=0)
        later = a.all_reduce(np.full(3, 5.0), timeout=LONG)
        results = await asyncio.gather(
            bad,
            later,
            b.all_reduce(np.ones(3), timeout=LONG),
            b.all_reduce(np.full(3, 7.0), timeout=LONG),
            return_exceptions=True,
        )
        assert isinstance(results[0], UsageError)
        assert isinstance(results[2], MismatchError)
        assert "failed before it started: UsageError" in str(results[2])
        np.testing.assert_array_equal(results[1], np.full(3, 12.0))
        np.testing.assert_array_equal(results[3], np.full(3, 12.0))
        await in_step(gs, 2)


async def test_a_sub_group_call_cancelled_before_it_ran() -> None:
    async with groups(3) as gs:
        subs = await asyncio.gather(*(g.split(0 if g.rank < 2 else None) for g in gs))
        s0, s1 = subs[0], subs[1]
        assert s0 is not None and s1 is not None
        skipped = cancelled_before_start(s1)
        with pytest.raises(asyncio.CancelledError):
            await skipped
        with pytest.raises(MismatchError, match="cancelled before it started") as err:
            await s0.all_reduce(np.ones(3), timeout=LONG)
        assert err.value.peer == gs[0].peer_label(1)  # named by its rank in the root group
        await in_step([s0, s1], 1)
        await in_step(gs, 2)


async def test_world_one_and_unusable_groups_take_no_id() -> None:
    async with groups(1) as gs:
        call = gs[0].all_reduce(np.ones(2))
        assert not isinstance(call, CollectiveCall)
        await call
    g = Group.from_seed("never-started", rank=0, world=2, peers=["127.0.0.1:1", "127.0.0.1:2"])
    call = g.all_reduce(np.ones(2))
    assert not isinstance(call, CollectiveCall)
    with pytest.raises(UsageError, match="not started"):
        await call


async def test_closing_a_sub_group_with_a_call_made_but_not_started() -> None:
    async with groups(2) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        s0, s1 = subs[0], subs[1]
        assert s0 is not None and s1 is not None
        await in_step([s0, s1], 1)
        made = s0.all_reduce(np.ones(3), timeout=LONG)  # called, never started
        await s0.close()
        with pytest.raises(MismatchError, match="sub-group was closed before it started"):
            await s1.all_reduce(np.ones(3), timeout=LONG)
        with pytest.raises(ConnectionBrokenError, match="closed the sub-group"):
            await s1.all_reduce(np.ones(3), timeout=LONG)  # the next: s0 is gone
        with pytest.raises(GroupBrokenError, match="closed"):
            await made
        await in_step(gs, 2)  # the parent goes on


async def test_a_refused_call_closed_later_leaves_the_call_that_took_its_id_alone() -> None:
    async with groups(2) as gs:
        a, b = gs
        bad = a.all_reduce(np.ones(3), timeout=0)
        with pytest.raises(UsageError):
            await bad  # its id is given back ...
        retry = a.all_reduce(np.full(3, 2.0), timeout=LONG)  # ... and taken again here
        bad.close()  # nothing: it holds no id any more
        outs = await asyncio.gather(retry, b.all_reduce(np.full(3, 3.0), timeout=LONG))
        for out in outs:
            np.testing.assert_array_equal(out, np.full(3, 5.0))


async def test_a_call_collected_unawaited_in_another_thread_still_tells_the_others() -> None:
    async with groups(2) as gs:
        a, b = gs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cycle: list[object] = [a.all_reduce(np.ones(3))]
            cycle.append(cycle)  # only the cyclic collector frees it ...
            del cycle
            await asyncio.to_thread(gc.collect)  # ... here in a thread with no loop
        with pytest.raises(MismatchError, match="never awaited"):
            await b.all_reduce(np.ones(3), timeout=LONG)
        assert not a._pending
        await in_step(gs, 1)


async def test_a_call_made_in_another_thread_takes_its_id_on_the_loop() -> None:
    async with groups(2) as gs:
        a, b = gs
        loop = asyncio.get_running_loop()

        def from_thread() -> np.ndarray:
            call = a.all_reduce(np.full(3, 1.0), timeout=LONG)
            assert not isinstance(call, CollectiveCall)  # nothing reserved off the loop
            return asyncio.run_coroutine_threadsafe(call, loop).result(LONG)

        outs = await asyncio.gather(
            asyncio.to_thread(from_thread), b.all_reduce(np.full(3, 2.0), timeout=LONG)
        )
        for out in outs:
            np.testing.assert_array_equal(out, np.full(3, 3.0))


async def test_a_call_awaited_on_another_threads_loop_is_refused_at_once() -> None:
    """asyncio.run(g.all_reduce(x)) in a worker thread: the group's connections wake only
    the group's loop, so the call would stall until a timer; it is refused at once, made
    there or made on the group's loop and handed over, and the group stays in step."""
    async with groups(2) as gs:
        a = gs[0]
        made_here = a.all_reduce(np.ones(3), timeout=LONG)
        assert isinstance(made_here, CollectiveCall)

        def in_a_thread() -> list[str]:
            errors = []
            for call in (made_here, a.all_reduce(np.ones(3)), a.send(np.ones(3), 1), a.recv(1)):
                try:
                    asyncio.run(call)  # type: ignore[arg-type]
                except UsageError as exc:
                    errors.append(str(exc))
            return errors

        loop = asyncio.get_running_loop()
        start = loop.time()
        errors = await asyncio.to_thread(in_a_thread)
        assert loop.time() - start < 5.0  # not a timing test: a stall lasts until LONG
        assert len(errors) == 4, errors
        for err in errors:
            assert "another event loop than the group's" in err
            assert "run_coroutine_threadsafe" in err
        await in_step(gs, 1)


async def test_a_call_awaited_on_another_loop_after_a_later_call_leaves_a_gap_from_the_loop() -> (
    None
):
    """The call refused on another thread's loop cannot give its id back (a later call
    has one): its gap is made, and the others told, on the group's own loop, not from
    the foreign thread (asyncio's transports are not thread-safe)."""
    async with groups(2) as gs:
        a, b = gs
        first = a.all_reduce(np.ones(3), timeout=LONG)
        later = a.all_reduce(np.full(3, 5.0), timeout=LONG)
        home = threading.get_ident()
        senders: list[int] = []
        conn = a.connection(1)
        send_nowait = conn.send_nowait

        def spy(*args: Any, **kwargs: Any) -> None:
            senders.append(threading.get_ident())
            send_nowait(*args, **kwargs)

        conn.send_nowait = spy  # type: ignore[method-assign]

        def in_a_thread() -> str:
            try:
                asyncio.run(first)  # type: ignore[arg-type]
            except UsageError as exc:
                return str(exc)
            return "no error"

        assert "another event loop" in await asyncio.to_thread(in_a_thread)
        with pytest.raises(MismatchError, match="did not run all_reduce"):
            await b.all_reduce(np.ones(3), timeout=LONG)
        outs = await asyncio.gather(later, b.all_reduce(np.full(3, 1.0), timeout=LONG))
        for out in outs:
            np.testing.assert_array_equal(out, np.full(3, 6.0))
        assert senders and set(senders) == {home}, senders


async def test_collectives_still_look_like_coroutine_functions() -> None:
    for name in ("all_reduce", "barrier", "split", "send", "recv"):
        assert asyncio.iscoroutinefunction(getattr(Group, name)), name
        if sys.version_info >= (3, 12):
            assert inspect.iscoroutinefunction(getattr(Group, name)), name
    spec = mock.create_autospec(Group, instance=True)
    assert isinstance(spec.all_reduce, mock.AsyncMock)
    assert isinstance(spec.send, mock.AsyncMock)
    async with groups(2) as gs:
        tasks = [asyncio.ensure_future(g.all_reduce(np.ones(3))) for g in gs]
        assert "all_reduce" in repr(tasks[0])
        await asyncio.sleep(0)
        assert tasks[0].get_stack()  # the method coroutine's frame
        await asyncio.gather(*tasks)


async def test_a_call_made_while_a_rank_was_gone_fails_if_it_starts_after_it_rejoined() -> None:
    # The rejoined process starts at the survivor's next call id, which counts the call
    # made meanwhile: that call can never have its part, so it fails at its start naming
    # it, and the next calls pair (they used to time out on ids the rejoiner never ran).
    async with groups(2, config={"on_peer_loss": "leave"}) as gs:
        crash(gs[1])
        await until_left(gs[:1], 1)
        held = gs[0].all_reduce(np.ones(3), timeout=LONG)  # made, not started
        back = await restart(gs[1])
        try:
            await back.start()
            with pytest.raises(ConnectionBrokenError, match="left the group while all_reduce"):
                await held
            await in_step([gs[0], back], 1)
        finally:
            await back.close()


def _late_barrier_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give Group a collective that awaits (0.2 s) before it takes its id."""
    from p2pdist.group import algorithms as alg
    from p2pdist.group.calls import collective
    from p2pdist.group.link import describe_call

    async def late_barrier(self: Group) -> None:
        await asyncio.sleep(0.2)
        await self._run(describe_call("barrier", "", "", ()), LONG, alg.barrier)

    monkeypatch.setattr(Group, "late_barrier", collective(late_barrier), raising=False)


async def test_a_collective_that_awaits_before_it_runs_keeps_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_barrier_group(monkeypatch)
    async with groups(2) as gs:
        calls = []
        for g in gs:  # on each rank: the late barrier is made first, then an all_reduce
            calls += [g.late_barrier(), g.all_reduce(np.full(3, 1.0 + g.rank), timeout=LONG)]
        got = await asyncio.gather(*calls)
        np.testing.assert_array_equal(got[1], np.full(3, 3.0))
        np.testing.assert_array_equal(got[3], np.full(3, 3.0))
        assert all(not g._pending for g in gs)


# ---- awaited in a coroutine (not as a task): CollectiveCall.__await__ ------------------


@pytest.mark.parametrize("heard", [0, 1], ids=["first-wait", "later-wait"])
async def test_an_awaited_call_cancelled_mid_flight_breaks_the_group_and_tells_the_others(
    heard: int,
) -> None:
    # The call's first wait goes through CollectiveCall, later ones straight to the
    # method's coroutine: a cancellation thrown into either must reach the call, as it
    # does for a task. heard=1: rank 1 joins the barrier (rank 0 wakes once, then waits
    # for rank 2, which never comes).
    async with groups(3) as gs:
        a, b, c = gs
        await in_step(gs, 1)

        async def awaiting() -> None:
            await a.barrier(timeout=LONG)

        task = asyncio.create_task(awaiting())
        joined = asyncio.create_task(b.barrier(timeout=LONG)) if heard else None
        await asyncio.sleep(0.2)  # a sent its part, heard from b if it joined, and waits
        assert not a._pending  # the call took its id
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(a.broken, GroupBrokenError)
        assert "cancelled on rank 0" in str(a.broken)
        # c is told (b's barrier fails at once, naming rank 0, when it joined).
        for _ in range(200):
            if c.broken is not None:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(GroupBrokenError, match="cancelled on rank 0"):
            await c.barrier(timeout=LONG)
        if joined is not None:
            with pytest.raises(GroupBrokenError):
                await joined


async def test_an_awaited_call_that_awaits_before_it_runs_keeps_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_barrier_group(monkeypatch)
    async with groups(2) as gs:

        async def rank(g: Group) -> np.ndarray:
            first = g.late_barrier()  # type: ignore[attr-defined]
            second = g.all_reduce(np.full(3, 1.0 + g.rank), timeout=LONG)
            later = asyncio.ensure_future(second)  # made second, starts first
            await first  # its steps before it takes its id go through the call
            return await later

        for got in await asyncio.gather(*(rank(g) for g in gs)):
            np.testing.assert_array_equal(got, np.full(3, 3.0))
        assert all(not g._pending for g in gs)


async def test_an_awaited_call_cancelled_before_it_took_its_id_tells_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_barrier_group(monkeypatch)
    async with groups(2) as gs:
        a, b = gs

        async def awaiting() -> None:
            await a.late_barrier()  # type: ignore[attr-defined]

        task = asyncio.create_task(awaiting())
        await asyncio.sleep(0.05)  # inside its sleep: its id is still reserved
        assert a._pending
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not a._pending and a.broken is None
        with pytest.raises(MismatchError, match="cancelled before it started"):
            await b.barrier(timeout=LONG)
        await in_step(gs, 2)


def test_a_notice_and_goodbye_read_by_the_calls_own_receive_still_name_the_dropped_call() -> None:
    # Rank 1 drops a call (cancelled before it ran) and closes its group while rank 0
    # computes (its loop does not run): rank 0's next call reads the notice and the
    # goodbye itself, inside its own task (the early read), and must fail as when its
    # loop reads them: naming the dropped call, the group not broken.
    peers = loopback_peers(2)
    cfg = GroupConfig(timeout=LONG, connect_timeout=20, transport=TransportConfig(tls=False))
    seed = "test-seed-0123456789"
    formed, dropped = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    async def rank1() -> None:
        async with Group.from_seed(seed, rank=1, world=2, peers=peers, config=cfg) as g:
            await g.all_reduce(np.ones(3))
            formed.wait(20)
            task = asyncio.ensure_future(g.all_reduce(np.ones(3)))
            task.cancel()  # before its first step
            await asyncio.gather(task, return_exceptions=True)
        dropped.set()

    async def rank0() -> None:
        async with Group.from_seed(seed, rank=0, world=2, peers=peers, config=cfg) as g:
            await g.all_reduce(np.ones(3))
            formed.set()
            dropped.wait(20)  # computing: this loop does not run meanwhile
            try:
                await g.all_reduce(np.ones(3))
            except Exception as exc:
                outcome["error"] = exc
            outcome["broken"] = g.broken

    other = threading.Thread(target=lambda: asyncio.run(rank1()), daemon=True)
    other.start()
    asyncio.run(asyncio.wait_for(rank0(), 60))
    other.join(30)
    assert dropped.is_set()
    err = outcome.get("error")
    assert isinstance(err, MismatchError), err
    assert "cancelled before it started" in str(err)
    assert outcome["broken"] is None
