"""Edges of compressed and deterministic reductions: one call at a time per ErrorFeedback,
signed zeros of deterministic max/min at world 2, the float16 range of a compressed
reduce on its root, and the int8 ``block`` checked whatever the wire."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import (
    ErrorFeedback,
    GroupBrokenError,
    MismatchError,
    P2PTimeoutError,
    PeerTimeoutError,
    UsageError,
)
from p2pdist.group.ops import reduce_op
from p2pdist.group.ordered import ordered_reduce


@pytest.mark.parametrize("config", [{}, {"chunk_bytes": 4096, "small_bytes": 0}])
async def test_a_second_call_with_a_busy_error_feedback_waits_for_the_first(
    config: dict[str, Any],
) -> None:
    """Two calls in flight with one ErrorFeedback: the second started from the first's
    residual before the first had rolled it back, and gave a wrong result silently (an
    audit: 5.9e35 for 2.0). It waits for the first now, on every rank, as if the caller
    had awaited the first: the first's overflow is rolled back, and the second is
    exact. Timing does not matter (the default settings, where the first call may end
    on one rank before the second is made, and many small chunks, where it may not)."""
    async with groups(2, timeout=10, config=config) as gs:
        efs = [ErrorFeedback() for _ in gs]
        xa = np.ones(20_000, np.float32)
        xa[0] = 2e38 + 1.3e36  # bfloat16 loses about 1e36 here; the sum overflows
        xb = np.ones(20_000, np.float32)

        async def rank(g: Any) -> list[Any]:
            ef = efs[g.rank]
            calls = [
                g.all_reduce(x.copy(), wire_dtype="bfloat16", error_feedback=ef) for x in (xa, xb)
            ]
            return list(await asyncio.gather(*calls))

        for ra, rb in await asyncio.gather(*(rank(g) for g in gs)):
            assert np.isinf(ra[0]) and (ra[1:] == 2.0).all()
            assert (rb == 2.0).all(), rb


async def test_a_waiting_error_feedback_call_of_another_size_is_refused_when_its_turn_comes() -> (
    None
):
    """A fresh ErrorFeedback shared by two calls of different sizes: the second waits for
    the first, then is a UsageError on every rank alike before it runs (it used to fail
    inside the running call, leaving the other ranks to their timeout); reduce_scatter
    holds it as all_reduce does, and the group goes on."""
    async with groups(2, timeout=10) as gs:

        async def rank(g: Any) -> list[Any]:
            ef = ErrorFeedback()
            calls = [
                g.all_reduce(np.ones(20_000, np.float32), wire_dtype="int8", error_feedback=ef),
                g.reduce_scatter(np.ones(20, np.float32), wire_dtype="int8", error_feedback=ef),
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))

        for ra, rb in await asyncio.gather(*(rank(g) for g in gs)):
            assert isinstance(rb, UsageError) and "use one ErrorFeedback per tensor" in str(rb)
            assert (ra == 2.0).all()
        outs = await asyncio.gather(*(g.all_reduce(np.ones(4, np.float32)) for g in gs))
        assert all((o == 2.0).all() for o in outs)


async def test_calls_with_one_error_feedback_take_their_turns_in_call_order() -> None:
    """The calls take the feedback in the order they were made, whatever order they
    start in: rank 0 starts its second call first, rank 1 its first (turns given in
    the order the calls asked deadlocked the two ranks until the timeout: a reviewer).
    A call that ends without running gives its turn up; and a call whose earlier one
    with the same feedback never starts fails after its timeout instead of waiting for
    ever."""
    async with groups(2, timeout=5) as gs:
        efs = [ErrorFeedback() for _ in gs]

        async def rank(g: Any, reverse: bool) -> list[Any]:
            ef = efs[g.rank]
            calls = [
                g.all_reduce(np.full(8, v, np.float32), wire_dtype="int8", error_feedback=ef)
                for v in (1.0, 2.0)
            ]
            unrun = g.all_reduce(np.ones(8, np.float32), wire_dtype="int8", error_feedback=ef)
            unrun.close()  # made, then dropped: its turn is given up (as its call id)
            return list(await asyncio.gather(*(calls[::-1] if reverse else calls)))

        outs = await asyncio.wait_for(asyncio.gather(rank(gs[0], True), rank(gs[1], False)), 4)
        assert (outs[0][1] == 2.0).all() and (outs[0][0] == 4.0).all(), outs[0]
        assert (outs[1][0] == 2.0).all() and (outs[1][1] == 4.0).all(), outs[1]
        # The group is in step after the dropped call (both ranks dropped it).
        await asyncio.gather(*(g.barrier() for g in gs))
        ef = efs[0]
        first = gs[0].all_reduce(np.ones(8, np.float32), wire_dtype="int8", error_feedback=ef)
        with pytest.raises(P2PTimeoutError, match="has not started"):
            await gs[0].all_reduce(
                np.ones(8, np.float32), wire_dtype="int8", error_feedback=ef, timeout=0.3
            )
        first.close()


async def test_an_error_feedback_is_released_when_its_call_fails_or_is_cancelled() -> None:
    """A call that times out, and one cancelled while it waits for its peer, leave their
    ErrorFeedback free for the next call; so does a call cancelled while it waits for
    its turn."""
    async with groups(2, timeout=10) as gs:
        ef = ErrorFeedback()
        x = np.ones(8, np.float32)
        task = asyncio.create_task(gs[0].all_reduce(x, wire_dtype="int8", error_feedback=ef))
        await asyncio.sleep(0.05)  # it runs, waiting for rank 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(ef.hold(8, -1, 1), 1)  # free again
        ef.end(-1)
    async with groups(2, timeout=10) as gs:
        ef = ErrorFeedback()
        with pytest.raises(PeerTimeoutError):
            await gs[0].reduce_scatter(x, wire_dtype="int8", error_feedback=ef, timeout=0.2)
        await asyncio.wait_for(ef.hold(8, -1, 1), 1)
        ef.end(-1)
    ef = ErrorFeedback()
    for order in (0, 1, 2):
        ef.take_ticket(order)
    await ef.hold(8, 0, 1)
    waiting = asyncio.create_task(ef.hold(8, 1, 5))
    last = asyncio.create_task(ef.hold(8, 2, 5))
    await asyncio.sleep(0.01)
    waiting.cancel()  # while it waits for its turn
    with pytest.raises(asyncio.CancelledError):
        await waiting
    ef.end(1)  # (what its call does as it ends)
    ef.end(0)
    await asyncio.wait_for(last, 1)  # its turn came
    ef.end(2)
    await asyncio.wait_for(ef.hold(8, -1, 1), 1)
    ef.end(-1)


@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter"])
async def test_a_failed_call_leaves_the_error_feedback_residual_as_it_found_it(
    method: str,
) -> None:
    """A call that fails once it began (it times out: rank 1 never joins) never reached
    the sum: the residual is the one the good step before it left, not the failed step's
    loss (which replaced it: an audit). And a call waiting for its turn behind one that
    is still running says so when it times out (it said the other had not started)."""
    rng = np.random.default_rng(3)
    async with groups(2, timeout=10) as gs:
        efs = [ErrorFeedback() for _ in gs]
        xs = [rng.standard_normal(4096).astype(np.float32) for _ in gs]
        await asyncio.gather(
            *(
                getattr(g, method)(xs[g.rank], wire_dtype="int8", error_feedback=efs[g.rank])
                for g in gs
            )
        )
        ef = efs[0]
        assert ef.residual is not None and np.abs(ef.residual).max() > 0
        kept = ef.residual.copy()
        y = rng.standard_normal(4096).astype(np.float32)
        running = asyncio.create_task(
            getattr(gs[0], method)(y, wire_dtype="int8", error_feedback=ef, timeout=0.6)
        )
        await asyncio.sleep(0.2)  # it runs, waiting for rank 1
        assert ef.residual.tobytes() != kept.tobytes()  # it applied the feedback
        with pytest.raises(P2PTimeoutError, match="that one is still running"):
            await getattr(gs[0], method)(y, wire_dtype="int8", error_feedback=ef, timeout=0.1)
        with pytest.raises(PeerTimeoutError):
            await running
        assert ef.residual.tobytes() == kept.tobytes()


async def test_a_call_that_waited_for_its_error_feedback_is_refused_if_the_group_broke() -> None:
    """A call waiting for its turn with the feedback while another call broke the group
    (a mismatch) is refused as it starts: it ran on, applying the feedback on a broken
    group (a reviewer)."""
    async with groups(2, timeout=5) as gs:
        ef = ErrorFeedback()
        applied = []
        apply = ef.apply
        ef.apply = lambda *a, **k: (applied.append(1), apply(*a, **k))[1]  # type: ignore[method-assign]

        async def rank0() -> list[Any]:
            calls = [
                gs[0].all_reduce(np.ones(8, np.float32), wire_dtype="int8", error_feedback=ef)
                for _ in range(2)
            ]
            return list(await asyncio.gather(*calls, return_exceptions=True))

        async def rank1() -> None:
            await asyncio.sleep(0.3)
            with pytest.raises(MismatchError):
                await gs[1].all_reduce(np.ones(9, np.float32), wire_dtype="int8")

        first, second = (await asyncio.gather(rank0(), rank1()))[0]
        assert isinstance(first, MismatchError), first
        assert isinstance(second, GroupBrokenError), second
        assert len(applied) == 1, applied


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["max", "min", "sum", "prod"])
def test_ordered_reduce_of_two_equals_the_float64_fold_bitwise(dtype: str, op: str) -> None:
    """World 2's two-part shortcut gives the float64 rank-ordered fold's bits: for sum and
    prod (one correctly rounded operation), and for max and min, whose float16 and float32
    loops keep the other signed zero, so they take the fold."""
    rng = np.random.default_rng(7)
    vals = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 65504.0, 6e-8, 3e38], np.float64)
    a = np.concatenate([np.repeat(vals, vals.size), rng.standard_normal(500) * 1e3])
    b = np.concatenate([np.tile(vals, vals.size), rng.standard_normal(500) * 1e3])
    with np.errstate(over="ignore", invalid="ignore"):
        parts = [a.astype(dtype), b.astype(dtype)]
        rop = reduce_op(op, np.dtype(dtype))
        fold = rop.ufunc(parts[0].astype(np.float64), parts[1].astype(np.float64))
        want = fold.astype(dtype)
        want[np.isnan(want)] = np.nan  # every NaN the one NaN (x86's inf - inf is -NaN)
        got = np.empty_like(parts[0])
        ordered_reduce(parts, rop, 2, got)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
async def test_deterministic_max_min_at_world_2_keep_the_folds_signed_zero(dtype: str) -> None:
    async with groups(2) as gs:
        for first in (0.0, -0.0):
            xs = [np.array([first] * 3, dtype), np.array([-first] * 3, dtype)]
            for op, ufunc in (("max", np.maximum), ("min", np.minimum)):
                want = ufunc(xs[0].astype(np.float64), xs[1].astype(np.float64)).astype(dtype)
                outs = await asyncio.gather(
                    *(g.all_reduce(xs[g.rank], op, mode="deterministic") for g in gs)
                )
                for out in outs:
                    assert out.tobytes() == want.tobytes(), (op, first, out, want)


@pytest.mark.parametrize("world", [2, 3])
async def test_compressed_reduce_float16_range_is_all_reduces_on_the_root_too(world: int) -> None:
    """reduce with a float16 wire: a sum of 65520 or more is inf on every piece of dst's
    result, its own included, as all_reduce gives (dst kept its own piece finite); and
    so is every rank's own piece of reduce_scatter."""
    async with groups(world) as gs:
        for n in (8, 40_000):
            x = np.full(n, 40000.0, np.float32)
            x[1::2] *= -1
            ar = await asyncio.gather(*(g.all_reduce(x, wire_dtype="float16") for g in gs))
            for dst in (0, world - 1):
                rd = await asyncio.gather(*(g.reduce(x, dst, wire_dtype="float16") for g in gs))
                got = rd[dst]
                assert got is not None
                assert got.tobytes() == ar[0].tobytes(), (n, dst, np.unique(got))
                assert np.isinf(got).all()
                # mean stays in range: finite everywhere
                md = await asyncio.gather(
                    *(g.reduce(x, dst, "mean", wire_dtype="float16") for g in gs)
                )
                assert md[dst] is not None
                np.testing.assert_allclose(md[dst], x, rtol=1e-3)
            # reduce_scatter: each rank's own piece too (a reviewer: it stayed finite)
            rs = await asyncio.gather(*(g.reduce_scatter(x, wire_dtype="float16") for g in gs))
            assert np.concatenate(rs).tobytes() == ar[0].tobytes(), n


@pytest.mark.parametrize("wire", [None, "float16", "bfloat16", "int8"])
async def test_block_is_checked_whatever_the_wire(wire: str | None) -> None:
    """A block that is not an integer of at least 1 is a UsageError on every reduction,
    with any wire or none; a good one is taken (unused but for int8)."""
    async with groups(2) as gs:
        g = gs[0]
        x = np.ones(8, np.float32)
        for block in (0, -3, "abc", 2.5, True, None):
            # One at a time: a refused call gives its id back only while it is the last
            with pytest.raises(UsageError, match="block size must be an integer of at least 1"):
                await g.all_reduce(x, wire_dtype=wire, block=block)
            with pytest.raises(UsageError, match="block size must be an integer of at least 1"):
                await g.reduce_scatter(x, wire_dtype=wire, block=block)
            with pytest.raises(UsageError, match="block size must be an integer of at least 1"):
                await g.reduce(x, 0, wire_dtype=wire, block=block)
        for block in (1, np.int64(64), 256):
            outs = await asyncio.gather(
                *(h.all_reduce(x, wire_dtype=wire, block=block) for h in gs)  # type: ignore[arg-type]
            )
            assert all((o == 2.0).all() for o in outs)
