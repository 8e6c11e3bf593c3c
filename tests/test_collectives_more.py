"""reduce, gather, scatter, all_to_all and all_to_all_v against numpy."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest
from collective_tour import every_collective_at_once
from group_helpers import groups, slow_link

from p2pdist import (
    ConnectionBrokenError,
    Group,
    GroupBrokenError,
    MismatchError,
    P2PError,
    PeerTimeoutError,
    UsageError,
)
from p2pdist.group import p2p as p2p_module


def data(rank: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(100 * seed + rank).standard_normal(shape)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 2, 1000, 100_000])
async def test_reduce_and_gather_to_every_root(world: int, n: int) -> None:
    async with groups(world) as gs:
        xs = [data(r, (n,), seed=n) for r in range(world)]
        copies = [x.copy() for x in xs]
        for root in range(world):
            outs = await asyncio.gather(*(g.reduce(xs[g.rank], root) for g in gs))
            for r, o in enumerate(outs):
                if r == root:
                    assert o is not None
                    np.testing.assert_allclose(o, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
                else:
                    assert o is None
            gathered = await asyncio.gather(*(g.gather(xs[g.rank], root) for g in gs))
            assert gathered[root] is not None
            np.testing.assert_array_equal(gathered[root], np.stack(xs))
            assert all(o is None for r, o in enumerate(gathered) if r != root)
        for x, c in zip(xs, copies, strict=True):
            np.testing.assert_array_equal(x, c)  # inputs untouched


@pytest.mark.parametrize("world", [1, 2, 4])
async def test_scatter(world: int) -> None:
    async with groups(world) as gs:
        blocks = data(0, (world, 3, 2))
        item = np.empty((3, 2))

        async def one(g: Group) -> np.ndarray:
            if g.rank == world - 1:
                return await g.scatter(blocks, src=world - 1)
            return await g.scatter(None, src=world - 1, like=item)

        outs = await asyncio.gather(*(one(g) for g in gs))
        for r, o in enumerate(outs):
            np.testing.assert_array_equal(o, blocks[r])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
async def test_all_to_all(world: int) -> None:
    async with groups(world) as gs:
        xs = [
            np.arange(world * 4, dtype=np.int64).reshape(world, 4) + 100 * r for r in range(world)
        ]
        outs = await asyncio.gather(*(g.all_to_all(xs[g.rank]) for g in gs))
        for r, o in enumerate(outs):
            for p in range(world):
                np.testing.assert_array_equal(o[p], xs[p][r])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
async def test_all_to_all_v_with_zero_counts(world: int) -> None:
    async with groups(world) as gs:
        rng = np.random.default_rng(world)
        counts = rng.integers(0, 4, size=(world, world))
        counts[0, :] = 0  # rank 0 sends nothing to anyone
        if world > 1:
            counts[:, 1] = 0  # nobody sends anything to rank 1
        parts = [
            [np.full((counts[r, p], 2), 10 * r + p, np.float32) for p in range(world)]
            for r in range(world)
        ]
        outs = await asyncio.gather(*(g.all_to_all_v(parts[g.rank]) for g in gs))
        for r, got in enumerate(outs):
            assert len(got) == world
            for p in range(world):
                np.testing.assert_array_equal(got[p], parts[p][r])
                assert got[p].shape == (counts[p, r], 2)


async def test_all_to_all_v_refuses_a_piece_over_max_message_bytes() -> None:
    """A peer's all_to_all_v piece was bounded by 1 TiB, not by max_message_bytes as
    docs/security.md says (an audit): now a piece over it is refused before it is
    allocated, naming the sender; one within it goes through."""
    async with groups(2, config={"max_message_bytes": 4096}) as gs:
        fits = [[np.ones((2, 8)), np.full((64, 8), 1.0 + r)] for r in range(2)]  # 4 KiB
        outs = await asyncio.gather(*(g.all_to_all_v(fits[g.rank]) for g in gs))
        assert outs[1][0].shape == (64, 8) and outs[0][1].shape == (2, 8)
        big = [np.ones((1, 8)), np.ones((65, 8))]  # rank 0 sends rank 1 4160 bytes
        results = await asyncio.gather(
            gs[0].all_to_all_v(big), gs[1].all_to_all_v(fits[1]), return_exceptions=True
        )
        err = results[1]
        assert isinstance(err, MismatchError), err
        assert "max_message_bytes=4096" in str(err) and gs[0].endpoint_id.short() in str(err)


async def test_more_collectives_check_their_arguments() -> None:
    async with groups(2) as gs:
        g = gs[0]
        with pytest.raises(UsageError, match="rows"):
            await g.all_to_all(np.ones((3, 2)))
        with pytest.raises(UsageError, match="row shape"):
            await g.all_to_all_v([np.ones((1, 2)), np.ones((1, 3))])
        with pytest.raises(UsageError, match=r"xs\[1\]"):  # a 0-d array after the first
            await g.all_to_all_v([np.ones((1, 2)), np.float64(1.0)])
        empty_rows = np.empty((2**40 + 1, 0))  # 0 bytes, more rows than a receiver takes
        with pytest.raises(UsageError, match=r"xs\[1\] has 1099511627777 rows"):
            await g.all_to_all_v([np.empty((2**40, 0)), empty_rows])
        with pytest.raises(UsageError, match="source"):
            await g.scatter(None, src=0)
        with pytest.raises(UsageError, match="like="):
            await gs[1].scatter(None, src=0)
        results = await asyncio.gather(
            gs[0].gather(np.ones(3), 0, timeout=5),
            gs[1].gather(np.ones(4), 0, timeout=5),
            return_exceptions=True,
        )
        assert any(isinstance(r, MismatchError) for r in results), results


async def test_split_into_subgroups_running_beside_the_parent() -> None:
    async with groups(5) as gs:
        subs = await asyncio.gather(
            *(g.split(None if g.rank == 4 else g.rank % 2, key=-g.rank) for g in gs)
        )
        assert subs[4] is None
        evens, odds = [subs[0], subs[2]], [subs[1], subs[3]]
        assert [s.rank for s in evens if s] == [1, 0]  # ordered by key = -rank
        assert all(s is not None and s.size == 2 for s in evens + odds)

        async def work(r: int) -> tuple[np.ndarray, np.ndarray | None]:
            world = gs[r].all_reduce(np.full(3, float(r)))
            sub = subs[r]
            part = sub.all_reduce(np.full(70_000, float(r))) if sub else None
            return await world, (await part if part is not None else None)

        results = await asyncio.gather(*(work(r) for r in range(5)))
        for r, (world, part) in enumerate(results):
            np.testing.assert_array_equal(world, np.full(3, 10.0))
            if r < 4:
                assert part is not None
                np.testing.assert_array_equal(part, np.full(70_000, 2.0 if r % 2 == 0 else 4.0))
        # point to point inside a sub-group, then a nested split
        a, b = odds
        assert a is not None and b is not None
        got = await asyncio.gather(a.send(np.arange(4), 1 - a.rank), b.recv(1 - b.rank))
        np.testing.assert_array_equal(got[1], np.arange(4))
        nested = await asyncio.gather(*(s.split(0) for s in (a, b)))
        out = await asyncio.gather(*(n.all_reduce(np.ones(2)) for n in nested if n))
        np.testing.assert_array_equal(out[0], [2.0, 2.0])


async def test_split_orders_by_key_then_old_rank_and_labels_peers_by_their_root_rank() -> None:
    async with groups(5) as gs:
        keys = {0: 0, 1: 0, 2: -1, 3: 0}  # rank 2 first, then a tie broken by old rank
        subs = await asyncio.gather(
            *(g.split(1 if g.rank == 4 else 0, key=keys.get(g.rank, 0)) for g in gs)
        )
        order = [2, 0, 1, 3]
        members = [subs[r] for r in order]
        assert [s.rank for s in members if s] == [0, 1, 2, 3]
        gathered = await asyncio.gather(
            *(s.all_gather(np.array([float(r)])) for r, s in zip(order, members, strict=True) if s)
        )
        for got in gathered:
            assert got.ravel().tolist() == [2.0, 0.0, 1.0, 3.0]
        sub = subs[0]
        assert sub is not None
        assert sub.peer_ids == [gs[0].peer_ids[r] for r in order]
        assert [sub.peer_label(i) for i in range(4)] == [gs[0].peer_label(r) for r in order]
        with pytest.raises(UsageError):
            sub.peer_label(4)
        with pytest.raises(UsageError):
            sub.peer_label(-1)
        alone = subs[4]
        assert alone is not None and alone.peer_label(0) == gs[0].peer_label(4)


async def test_gradient_buckets_reduce_everything_in_place_in_the_background() -> None:
    from p2pdist import GradientBuckets

    async with groups(3) as gs:
        shapes = [(10,), (300, 40), (7, 7), (50_000,), (3,)]
        grads = [
            # 3 + i, i, i: the mean 1 + i is no rank's own value
            [np.full(s, float(3 * (r == 0) + i), np.float32) for i, s in enumerate(shapes)]
            for r in range(3)
        ]
        buckets = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=np.int64(64 * 1024)) for g in gs)
        )

        def reduced(r: int, i: int) -> bool:
            return bool(np.array_equal(grads[r][i], np.full(shapes[i], 1.0 + i)))

        async def step(r: int) -> np.ndarray:
            for grad in grads[r]:
                buckets[r].add(grad)
            # the caller carries on while buckets reduce; its own collective is unaffected
            other = await gs[r].all_reduce(np.array([float(r)]))
            # the first four arrays passed 64 KiB: their bucket runs before wait() is called
            for _ in range(2000):  # (20 s: a loaded CI host)
                if reduced(r, 3):
                    break
                await asyncio.sleep(0.01)
            assert all(reduced(r, i) for i in range(4)), f"rank {r}: no bucket ran before wait"
            assert not reduced(r, 4)  # the last array's bucket is not full: wait() sends it
            await buckets[r].wait()
            return other

        others = await asyncio.gather(*(step(r) for r in range(3)))
        assert others[0].tolist() == [3.0]
        for r in range(3):
            for i, grad in enumerate(grads[r]):
                np.testing.assert_array_equal(grad, np.full(shapes[i], 1.0 + i))


@pytest.mark.parametrize("next_dtype", [np.float64, np.float32])
async def test_gradient_buckets_keep_their_order_when_a_step_starts_during_a_wait(
    next_dtype: type,
) -> None:
    """A bucket added while the last step's wait() still ran did not wait for that step's
    buckets: call ids then followed timing, ranks paired different buckets and summed
    the wrong arrays without an error. A second wait() returned before anything was
    reduced. (float32: the empty bucket that ends the first step took the dtype of the
    next step's array on the rank that had added it already, and the ranks' calls
    differed.)"""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=10) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=8, op="sum") for g in gs)
        )
        old = [[np.full(1, 1.0), np.full(1, 10.0)] for _ in range(2)]
        new = [np.full(1, 1000.0, next_dtype) for _ in range(2)]
        twice = [np.full(4, 1.0 + r) for r in range(2)]

        async def rank(r: int) -> None:
            b = bs[r]
            for a in old[r]:
                b.add(a)  # two buckets of one float64 each
            waiting = asyncio.create_task(b.wait())
            await asyncio.sleep(0 if r == 0 else 0.2)
            b.add(new[r])  # the next step begins before the last one's wait() returned
            await waiting
            await b.wait()
            b.add(twice[r])
            first = asyncio.create_task(b.wait())
            await asyncio.sleep(0)
            await b.wait()  # a second wait() returns once the buckets are reduced
            np.testing.assert_array_equal(twice[r], np.full(4, 3.0))
            await first

        await asyncio.wait_for(asyncio.gather(rank(0), rank(1)), 20)
        assert [[a[0] for a in o] for o in old] == [[2.0, 20.0]] * 2
        assert [x[0] for x in new] == [2000.0] * 2


async def test_a_second_wait_is_the_same_step_on_every_rank_whatever_the_timing() -> None:
    """Both ranks run: add, wait() in a task, some work, wait() again, then the task. A
    second wait() with nothing added ended an empty step where the first step's buckets
    were done already (rank 0, whose work took longer) and finished the first step where
    they still ran (rank 1): the ranks' buckets parted and the group broke (an audit)."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=10) as gs:
        bs = await asyncio.gather(*(GradientBuckets.create(g, op="sum") for g in gs))

        async def rank(r: int) -> list[float]:
            b = bs[r]
            for _ in range(3):
                grads = [np.full(1000, r + 1.0), np.full(10, r + 1.0)]
                for a in grads:
                    b.add(a)
                first = asyncio.create_task(b.wait())
                await asyncio.sleep(0.3 if r == 0 else 0)  # other work, longer on rank 0
                await b.wait()
                await first
            return [float(a[0]) for a in grads]

        got = await asyncio.wait_for(asyncio.gather(rank(0), rank(1)), 30)
        assert got == [[3.0, 3.0]] * 2


@pytest.mark.parametrize("misstep", ["skipped", "swapped"])
async def test_gradient_buckets_added_differently_on_one_rank_fail_on_every_rank(
    misstep: str,
) -> None:
    """Rank 1 skips an add (all arrays of one shape), or adds two arrays of different
    shapes but equal size in the other order. Each bucket's flat array had the others'
    size, so rank 1's wait() returned wrong means with no error (the others timed out
    waiting for a bucket it never sent). Now each bucket's call names its arrays and the
    last one the step's count: every rank's wait() fails, naming the buckets."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(3, timeout=10) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=8000, op="mean") for g in gs)
        )
        if misstep == "skipped":
            shapes = [(1000,)] * 5  # buckets of two
        else:
            shapes = [(1000,), (1000,), (10, 100), (100, 10), (7,)]

        async def step(r: int) -> None:
            arrays = [np.full(shape, 10.0 * r + i, np.float32) for i, shape in enumerate(shapes)]
            if r == 1:
                if misstep == "skipped":
                    del arrays[2]
                else:
                    arrays[2], arrays[3] = arrays[3], arrays[2]
            for a in arrays:
                bs[r].add(a)
            await bs[r].wait()

        results = await asyncio.wait_for(
            asyncio.gather(*(step(r) for r in range(3)), return_exceptions=True), 30
        )
        _every_rank_failed_naming(results, ", a bucket of ")
        notes = " ".join(getattr(results[1], "__notes__", []))
        assert "did not match another rank's" in notes, results[1]
        assert "no result of this step can be trusted" in notes


async def test_a_rank_with_nothing_to_add_fails_the_step_instead_of_shifting_a_step() -> None:
    """Rank 0 had no gradients at step 0 and still called wait(): a wait() with nothing
    added sent nothing, so rank 0's step-1 bucket was reduced with rank 1's step-0 bucket
    (same shape), every later step one off, rank 0 told nothing (found by an audit: 101
    and 301 where 201 and 401 were due). An empty step says so: both ranks fail it."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=5) as gs:
        bs = await asyncio.gather(*(GradientBuckets.create(g, op="sum") for g in gs))

        async def rank(r: int) -> None:
            for step in range(2):
                grad = np.full(4, 100.0 * step + r, np.float32)
                if not (r == 0 and step == 0):
                    bs[r].add(grad)
                await bs[r].wait()

        results = await asyncio.wait_for(
            asyncio.gather(*(rank(r) for r in range(2)), return_exceptions=True), 30
        )
        _every_rank_failed_naming(results, "a bucket of no arrays ending a step of 0 arrays")


def _every_rank_failed_naming(results: list[Any], text: str) -> None:
    """Every rank's step failed with the buckets' mismatch (or the group it broke),
    its error naming ``text``."""
    for r, res in enumerate(results):
        assert isinstance(res, MismatchError | GroupBrokenError), (r, res)
        assert text in str(res), (r, res)


async def test_steps_with_nothing_to_add_on_every_rank_go_on() -> None:
    """A step that adds nothing on every rank is a step too (an empty bucket ends it),
    and the steps after it reduce their own arrays."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(3, timeout=10) as gs:
        bs = await asyncio.gather(*(GradientBuckets.create(g, op="sum") for g in gs))

        async def rank(r: int) -> list[float]:
            got = []
            for step in range(4):
                grad = np.full(4, 100.0 * step + r, np.float32)
                if step % 2:  # steps 1 and 3 add nothing, anywhere
                    bs[r].add(grad)
                await bs[r].wait()
                got.append(float(grad[0]))
            return got

        results = await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(3))), 30)
        for r, got in enumerate(results):
            assert got == [0.0 + r, 303.0, 200.0 + r, 903.0], (r, got)


async def test_gradient_buckets_discard_an_abandoned_step() -> None:
    """A step abandoned between add and wait (an exception in the backward pass): its
    pending arrays joined the next step's first bucket, which then reduced a stale
    array (and, with error feedback, shifted every bucket's residual). discard() drops
    them; a bucket already started still completes and the next wait() waits for it."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=10) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=16, op="sum") for g in gs)
        )

        async def rank(r: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
            first = [np.full(2, 1.0 + r), np.full(1, 5.0 + r)]
            bs[r].add(first[0])  # 16 bytes: this bucket starts at once
            bs[r].add(first[1])  # pending
            bs[r].discard()
            second = [np.full(1, 10.0 * (r + 1))]
            bs[r].add(second[0])
            await bs[r].wait()
            return first, second

        (first0, second0), (first1, second1) = await asyncio.wait_for(
            asyncio.gather(rank(0), rank(1)), 20
        )
        np.testing.assert_array_equal(first0[0], [3.0, 3.0])  # started: reduced
        np.testing.assert_array_equal(first1[0], [3.0, 3.0])
        assert (first0[1][0], first1[1][0]) == (5.0, 6.0)  # dropped: left as it was
        assert (second0[0], second1[0]) == (30.0, 30.0)


@pytest.mark.parametrize("where", ["buffer", "pack"])
async def test_a_bucket_that_fails_before_its_all_reduce_fails_the_others_at_once(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A bucket that failed on one rank before its all_reduce (no memory for its
    buffer, packing failed as a GPU copy may) took no call id there, so the other ranks'
    bucket waited for it until their timeout (an audit, by reading). The bucket's call
    now takes its id when the bucket is queued: its failure is thrown into it,
    unstarted, and the others' bucket fails at once, naming the rank and why; the group
    goes on, and so does the failed rank's helper."""
    from p2pdist.group import buckets as buckets_module
    from p2pdist.group.buckets import GradientBuckets

    poisoned = np.full(4, 7.0, np.float32)  # rank 1's array whose bucket cannot be made
    fail_once = [MemoryError("no room for the bucket")]
    if where == "pack":
        real_pack = buckets_module.pack

        async def pack(arrays: list[Any], out: np.ndarray, seconds: float, **kw: Any) -> None:
            if fail_once and any(a is poisoned for a in arrays):
                raise fail_once.pop()
            await real_pack(arrays, out, seconds, **kw)

        monkeypatch.setattr(buckets_module, "pack", pack)
    else:
        real_buffer = buckets_module._bucket_buffer
        made: list[int] = []

        def buffer(size: int, dtype: np.dtype[Any], **kw: Any) -> np.ndarray:
            made.append(size)
            if len(made) == 2 and fail_once:  # rank 1's first bucket (rank 0 adds first)
                raise fail_once.pop()
            return real_buffer(size, dtype, **kw)

        monkeypatch.setattr(buckets_module, "_bucket_buffer", buffer)
    async with groups(2, timeout=60) as gs:
        bs = await asyncio.gather(*(GradientBuckets.create(g, op="sum") for g in gs))
        grads = [np.full(4, 1.0, np.float32), poisoned]
        for b, grad in zip(bs, grads, strict=True):
            b.add(grad)
        # Far below the timeout: without the fix rank 0 waits its full 60 s.
        results = await asyncio.wait_for(
            asyncio.gather(*(b.wait() for b in bs), return_exceptions=True), 10
        )
        assert isinstance(results[1], MemoryError), results[1]
        assert isinstance(results[0], P2PError), results[0]
        assert "rank 1" in str(results[0]) and "MemoryError" in str(results[0]), results[0]
        np.testing.assert_array_equal(grads[0], np.full(4, 1.0))  # left as added
        # Both ranks go on, the same arrays too: the next step reduces.
        for r, (b, grad) in enumerate(zip(bs, grads, strict=True)):
            grad[:] = 1.0 + r
            b.add(grad)
        await asyncio.wait_for(asyncio.gather(*(b.wait() for b in bs)), 10)
        for grad in grads:
            np.testing.assert_array_equal(grad, np.full(4, 3.0))
        got = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs)), 10)
        for x in got:
            np.testing.assert_array_equal(x, [2.0, 2.0])


async def test_gradient_buckets_keep_what_was_added_when_a_flush_has_no_loop() -> None:
    """add() from another thread (an autograd hook's) filled a bucket: flush raised for
    want of an event loop, after it had dropped every pending array."""
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=10) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=64, op="sum") for g in gs)
        )
        xs = [[np.full(3, 1.0 + r), np.full(5, 1.0 + r)] for r in range(2)]
        for r in range(2):
            bs[r].add(xs[r][0])
            with pytest.raises(RuntimeError, match="event loop"):
                await asyncio.to_thread(bs[r].add, xs[r][1])  # fills the bucket: flush
        await asyncio.wait_for(asyncio.gather(*(b.wait() for b in bs)), 10)
        for r in range(2):
            np.testing.assert_array_equal(xs[r][0], np.full(3, 3.0))
            np.testing.assert_array_equal(xs[r][1], np.full(5, 3.0))


async def test_gradient_buckets_refuse_masked_arrays_at_add() -> None:
    from p2pdist.group.buckets import GradientBuckets

    async with groups(2, timeout=10) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=1 << 20, op="sum") for g in gs)
        )
        with pytest.raises(UsageError, match="plain numpy or CuPy array"):
            bs[0].add(np.ma.zeros(3))
        await asyncio.gather(*(b.wait() for b in bs))


async def test_masked_arrays_and_matrices_do_not_break_the_group() -> None:
    """A masked array broke the group on every rank (or its mask was summed over
    silently); np.matrix broke reduce_scatter. Now: a UsageError before anything is
    sent, and a matrix reduces as the plain array it holds."""
    async with groups(2, timeout=10) as gs:
        masked = np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0])
        with pytest.raises(UsageError, match="masked"):
            await gs[0].all_reduce(masked)
        with pytest.raises(UsageError, match="out must be a numpy array"):
            await gs[1].recv(0, out=np.ma.zeros(3))
        xs = np.arange(4.0).reshape(2, 2)
        with pytest.raises(UsageError, match="overlaps"):  # it overwrote a row it sends
            await gs[0].scatter(xs, 0, out=xs[1])
        with pytest.warns(PendingDeprecationWarning):  # numpy's advice against np.matrix
            m = np.matrix([[1.0, 2.0], [3.0, 4.0]])
        parts = await asyncio.gather(*(g.reduce_scatter(m) for g in gs))
        np.testing.assert_array_equal(np.concatenate(parts), [[2.0, 4.0], [6.0, 8.0]])
        assert all(g.broken is None for g in gs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wire_dtyp": "float16"}, "'wire_dtyp'"),
        ({"out": None}, "no out="),
        ({"bucket_bytes": True}, "bucket_bytes must be an integer of at least 1"),
        ({"bucket_bytes": 1.5}, "bucket_bytes must be an integer of at least 1"),
        ({"timeout": -1}, "timeout must be a positive"),
        ({"timeout": True}, "timeout must be a positive"),
        ({"timeout": float("nan")}, "timeout must be a positive"),
        ({"op": "avg"}, "unknown op 'avg'"),
        ({"mode": "deterministic", "wire_dtype": "int8"}, "cannot be combined"),
        ({"wire_dtype": "float8"}, "wire_dtype must be"),
        ({"wire_dtype": "int8", "block": 0}, "block"),
        ({"op": "max", "wire_dtype": "int8"}, "floating sum/mean"),
    ],
)
async def test_gradient_buckets_refuse_unknown_keywords_at_create(
    kwargs: dict[str, Any], message: str
) -> None:
    """A misspelt all_reduce keyword used to pass create() and add(), then fail every
    bucket at wait() with a TypeError; a bad op, mode or wire setting passed create()
    (taking a sub-group) and failed at the first add()."""
    from p2pdist import GradientBuckets

    async with groups(2) as gs:
        with pytest.raises(UsageError, match=message):
            await GradientBuckets.create(gs[0], **kwargs)
        made = await asyncio.gather(  # the keywords it takes are still taken
            *(GradientBuckets.create(g, wire_dtype="int8", error_feedback=True) for g in gs)
        )
        await asyncio.gather(*(b.close() for b in made))


async def test_gradient_buckets_close_ends_their_sub_group_and_the_group_goes_on() -> None:
    from p2pdist import GradientBuckets

    async with groups(2) as gs:
        buckets = await asyncio.gather(*(GradientBuckets.create(g) for g in gs))
        subs = [b._group for b in buckets]

        async def step(b: GradientBuckets, r: int) -> tuple[np.ndarray, np.ndarray]:
            async with b:
                x = np.full(4, float(r), np.float32)
                b.add(x)
                await b.wait()
                late = np.full(8, 7.0, np.float32)
                if r == 0:  # a bucket rank 1 never joins: running when close() stops it
                    b.add(late)
                    b.flush()
                    await asyncio.sleep(0.1)
                    assert not b._tasks[0].done()
                else:  # closes after rank 0 (whose running bucket would fail at once)
                    await asyncio.sleep(0.5)
            with pytest.raises(UsageError, match="closed"):
                b.add(np.zeros(2, np.float32))
            with pytest.raises(UsageError, match="closed"):
                await b.wait()
            return x, late

        got = await asyncio.gather(*(step(b, r) for r, b in enumerate(buckets)))
        np.testing.assert_array_equal(got[0][0], np.full(4, 0.5, np.float32))
        np.testing.assert_array_equal(got[0][1], np.full(8, 7.0, np.float32))  # as added
        for sub in subs:
            with pytest.raises(GroupBrokenError):
                await sub.all_reduce(np.ones(2))
        total = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        np.testing.assert_array_equal(total[1], [2.0, 2.0])


async def test_concurrent_splits_get_distinct_spaces() -> None:
    async with groups(2) as gs:
        pairs = await asyncio.gather(*(asyncio.gather(g.split(0), g.split(0)) for g in gs))
        (a1, a2), (b1, b2) = pairs
        assert a1 is not None and a2 is not None and b1 is not None and b2 is not None
        assert a1._space != a2._space and (a1._space, a2._space) == (b1._space, b2._space)
        outs = await asyncio.gather(
            a1.all_reduce(np.ones(3)),
            a2.all_reduce(np.full(3, 2.0)),
            b1.all_reduce(np.ones(3)),
            b2.all_reduce(np.full(3, 2.0)),
        )
        assert [o[0] for o in outs] == [2.0, 4.0, 2.0, 4.0]


async def test_concurrent_splits_after_a_nested_split_never_share_a_space() -> None:
    """Ranks 0 and 1 split their sub-group once more, so their books are ahead of ranks
    2 and 3's; then two splits of the root run at once, A (everyone) and B (ranks 2, 3):
    the two sub-groups share the 2-3 connection and must not share a channel space
    (they used to: B's all_reduce then took A's messages, or timed out)."""
    async with groups(4, timeout=10) as gs:
        halves = await asyncio.gather(*(g.split(0 if g.rank < 2 else 1) for g in gs))
        await asyncio.gather(*(h.split(0) for h in halves[:2] if h))

        async def two_splits(g: Group) -> tuple[Group | None, Group | None]:
            a = asyncio.create_task(g.split(0))
            b = asyncio.create_task(g.split(0 if g.rank >= 2 else None))
            return await a, await b

        pairs = await asyncio.gather(*(two_splits(g) for g in gs))
        for r in (2, 3):
            a, b = pairs[r]
            assert a is not None and b is not None and a._space != b._space

        async def work(r: int) -> list[np.ndarray]:
            a, b = pairs[r]
            assert a is not None
            calls = [a.all_reduce(np.full(4, 1.0))]
            if b is not None:
                calls.append(b.all_reduce(np.full(4, 100.0)))
            return list(await asyncio.gather(*calls))

        out = await asyncio.gather(*(work(r) for r in range(4)))
        for r in range(4):
            assert [float(x[0]) for x in out[r]] == ([4.0] if r < 2 else [4.0, 200.0])


def delay_channel(g: Group, peer: int, channel: int, seconds: float) -> None:
    """Hold back ``g``'s messages to ``peer`` on ``channel`` (a collective's id) for
    ``seconds`` each: an uneven link, in one process."""
    conn = g._conns[peer]
    send = conn.send
    loop = asyncio.get_running_loop()

    async def held_send(ch: int, *args: Any, **kw: Any) -> None:
        if ch != channel:
            return await send(ch, *args, **kw)
        loop.call_later(seconds, lambda: loop.create_task(send(ch, *args, **kw)))

    conn.send = held_send  # type: ignore[method-assign]


async def test_a_split_takes_one_place_in_the_call_order_whatever_the_delays() -> None:
    """Each rank starts split(0) as a task, then awaits two all_reduces: the same order
    on every rank. The split's later round used to take its call id only when its first
    round ended, so with uneven delays the ranks numbered the calls differently and the
    group broke with a MismatchError (split against all_reduce)."""
    async with groups(2, timeout=10) as gs:
        delay_channel(gs[1], 0, 1, 0.5)  # rank 1's split message (call 1) to rank 0
        delay_channel(gs[0], 1, 0, 0.3)  # rank 0's all_reduce message (call 0) to rank 1

        async def user(g: Group) -> tuple[np.ndarray, np.ndarray, Group | None]:
            split = asyncio.create_task(g.split(0))
            a = await g.all_reduce(np.ones(3))
            b = await g.all_reduce(np.full(3, 2.0))
            return a, b, await split

        for a, b, sub in await asyncio.wait_for(asyncio.gather(*(user(g) for g in gs)), 20):
            assert a.tolist() == [2.0] * 3 and b.tolist() == [4.0] * 3
            assert sub is not None and sub.size == 2


async def test_a_split_against_an_all_gather_is_a_mismatch() -> None:
    async with groups(2) as gs:
        results = await asyncio.gather(
            gs[0].split(0, timeout=5),
            gs[1].all_gather(np.zeros(3, np.int64), timeout=5),
            return_exceptions=True,
        )
        assert all(isinstance(r, MismatchError) for r in results), results
        assert "split(color, key)" in str(results[1]), results


async def test_a_barrier_against_an_all_reduce_names_the_barrier_plainly() -> None:
    async with groups(2) as gs:
        results = await asyncio.gather(
            gs[0].barrier(timeout=5),
            gs[1].all_reduce(np.zeros(3), timeout=5),
            return_exceptions=True,
        )
        assert all(isinstance(r, MismatchError) for r in results), results
        assert "barrier()" in " ".join(map(str, results)), results  # it said barrier([])


async def test_disagreeing_roots_are_a_mismatch_not_a_silent_answer() -> None:
    async with groups(2) as gs:
        x = np.arange(4.0)
        results = await asyncio.gather(
            *(g.broadcast(x, src=g.rank, timeout=5) for g in gs), return_exceptions=True
        )
        assert all(isinstance(r, Exception) for r in results), results
        assert any(isinstance(r, MismatchError) for r in results), results


async def test_a_subgroup_failure_breaks_the_parent_loudly() -> None:
    from p2pdist import GroupBrokenError

    async with groups(2) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        results = await asyncio.gather(
            subs[0].all_reduce(np.ones(5), timeout=5),  # type: ignore[union-attr]
            subs[1].all_reduce(np.ones(6), timeout=5),  # type: ignore[union-attr]
            return_exceptions=True,
        )
        assert any(isinstance(r, MismatchError) for r in results), results
        for g in gs:
            with pytest.raises(GroupBrokenError):
                await g.all_reduce(np.ones(3), timeout=5)


# ---- landing places: received data goes straight into the result ------------------------


def landed(gs: list[Group]) -> int:
    """Frames received into a named place, over every connection of every rank."""
    return sum(
        g.connection(p).stats.landed_in_place for g in gs for p in range(g.size) if p != g.rank
    )


def places_left(gs: list[Group]) -> int:
    """Places still named on any connection (each call must let its places go)."""
    return sum(
        len(g.connection(p)._decoder._places)  # type: ignore[attr-defined]
        for g in gs
        for p in range(g.size)
        if p != g.rank
    )


async def test_large_collectives_receive_into_their_result() -> None:
    """The ring all-gather half of a large all-reduce and a chain broadcast receive most
    chunks straight into the result (counted by the connections), the results are right,
    and no call leaves a place behind."""
    async with groups(3) as gs:
        xs = [np.full(1 << 20, r + 1, np.float32) for r in range(3)]  # 4 MiB: 2 chunks each
        before = landed(gs)
        for _ in range(3):
            outs = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
            for out in outs:
                assert np.all(out == 6)
        after_reduce = landed(gs)
        assert after_reduce > before
        outs = await asyncio.gather(*(g.broadcast(xs[g.rank], src=1) for g in gs))
        for out in outs:
            assert np.all(out == 2)
        assert landed(gs) > after_reduce
        assert places_left(gs) == 0


@pytest.mark.parametrize("call", ["all_gather", "gather", "scatter", "all_to_all", "broadcast"])
async def test_rooted_and_direct_collectives_receive_into_their_result(call: str) -> None:
    """Each of these names its output before the messages come, so over a few calls some
    messages land in place (counted by the connections); results right, no place left.
    broadcast names its output only after the agreement round, which the root may finish
    first and send at once: its one-message path lands by luck of timing, so it runs the
    chain here (8000 bytes in two chunks), whose later chunks come after the naming."""
    chain = {"small_bytes": 1024, "chunk_bytes": 4096}
    async with groups(3, config=chain if call == "broadcast" else None) as gs:
        row = np.arange(2000, dtype=np.float32)
        before = landed(gs)
        for _ in range(4):
            if call == "all_gather":
                outs = await asyncio.gather(*(g.all_gather(row + g.rank) for g in gs))
                expect = np.stack([row + r for r in range(3)])
                assert all(np.array_equal(o, expect) for o in outs)
            elif call == "gather":
                outs = await asyncio.gather(*(g.gather(row + g.rank, dst=0) for g in gs))
                assert np.array_equal(outs[0], np.stack([row + r for r in range(3)]))
            elif call == "scatter":
                rows = np.stack([row + r for r in range(3)])
                outs = await asyncio.gather(
                    *(g.scatter(rows if g.rank == 0 else None, src=0, like=row) for g in gs)
                )
                assert all(np.array_equal(o, row + r) for r, o in enumerate(outs))
            elif call == "all_to_all":
                outs = await asyncio.gather(
                    *(g.all_to_all(np.stack([row + 10 * g.rank + p for p in range(3)])) for g in gs)
                )
                for r, o in enumerate(outs):
                    assert np.array_equal(o, np.stack([row + 10 * p + r for p in range(3)]))
            else:
                outs = await asyncio.gather(*(g.broadcast(row + g.rank, src=2) for g in gs))
                assert all(np.array_equal(o, row + 2) for o in outs)
        assert landed(gs) > before
        assert places_left(gs) == 0


async def test_all_gather_of_a_row_of_its_own_output() -> None:
    """``all_gather(buf[0], out=buf)`` (the input is a row of the output): every rank's
    own row goes out before any other rank's data can land in ``buf[0]``. The direct
    algorithm is forced for 8 MiB rows and the write buffer is small, so a send waits
    for the socket while the other ranks' messages arrive."""
    async with groups(3, config={"small_bytes": 64 << 20}, write_buffer_high=64 << 10) as gs:
        bufs = [np.zeros((3, 2 << 20), np.float32) for _ in gs]
        for g, buf in zip(gs, bufs, strict=True):
            buf[0] = g.rank + 1
        calls = [g.all_gather(buf[0], out=buf) for g, buf in zip(gs, bufs, strict=True)]
        await asyncio.gather(*calls)
        for buf in bufs:
            for p in range(3):
                assert np.all(buf[p] == p + 1), f"row {p}: {buf[p][:3]}"
        assert places_left(gs) == 0


def test_space_book_claims_refuse_what_another_split_holds_or_a_subgroup_uses() -> None:
    from p2pdist.group.spaces import SpaceBook

    book = SpaceBook(2)
    a, b = object(), object()
    assert book.propose(a) == 2 and book.propose(b) == 4
    assert not book.claim(4, a)  # b's proposal
    assert book.claim(2, a) and book.claim(6, a)  # its own proposal, and a free space
    assert not book.claim(6, b)  # a holds it until its split ends
    book.commit(6, a)  # a ends on 6 and lets 2 go
    assert not book.claim(6, b)  # a sub-group uses it now
    assert book.claim(2, b)
    book.release(b)
    assert book.propose(b, at_least=7) == 8 and book.next == 10


async def test_blocks_longer_than_a_frame_travel_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block longer than the largest frame a group sends (PIECE_BYTES, 64 MiB; here
    cut to 4 KiB, with the transport refusing frames over 8 KiB) goes in pieces: every
    collective that sends a whole block or segment works (they broke the group when a
    block passed the transport's 1 GiB frame limit), and a wrong size is still a
    MismatchError."""
    from p2pdist.group import config as config_module
    from p2pdist.group import link, p2p
    from p2pdist.wire.frames import FrameLimits

    for module, name in ((link, "PIECE_BYTES"), (config_module, "PIECE_BYTES"), (p2p, "CHUNK")):
        monkeypatch.setattr(module, name, 4096)
    small = {"chunk_bytes": 4096, "small_bytes": 4096}
    async with groups(3, config=small, limits=FrameLimits(max_payload=8192)) as gs:
        xs = [np.arange(3000, dtype=np.float64) + 1000 * r for r in range(3)]  # 24000 B
        table = np.stack(xs)

        async def each(call: Any) -> list[Any]:
            return list(await asyncio.gather(*(call(g) for g in gs)))

        got = await each(lambda g: g.gather(xs[g.rank], 1))
        np.testing.assert_array_equal(got[1], table)
        got = await each(lambda g: g.scatter(table if g.rank == 2 else None, 2, like=xs[0]))
        for r in range(3):
            np.testing.assert_array_equal(got[r], xs[r])
        got = await each(lambda g: g.reduce(xs[g.rank], 0))
        np.testing.assert_array_equal(got[0], table.sum(axis=0))
        got = await each(lambda g: g.all_to_all(np.stack([xs[g.rank] + p for p in range(3)])))
        for r in range(3):
            np.testing.assert_array_equal(got[r], np.stack([xs[p] + r for p in range(3)]))
        got = await each(lambda g: g.all_to_all_v([table[: (g.rank + p) % 3] for p in range(3)]))
        for r in range(3):
            for p in range(3):
                np.testing.assert_array_equal(got[r][p], table[: (p + r) % 3])
        got = await each(lambda g: g.all_reduce(xs[g.rank]))
        np.testing.assert_array_equal(got[2], table.sum(axis=0))
        sent = await asyncio.gather(gs[0].send(table, 1), gs[1].recv(0))
        np.testing.assert_array_equal(sent[1], table)
        results = await asyncio.gather(
            *(g.gather(xs[g.rank][: 2000 if g.rank else 3000], 1, timeout=5) for g in gs),
            return_exceptions=True,
        )
        assert any(isinstance(r, MismatchError) for r in results), results


async def test_closing_a_subgroup_fails_its_running_calls_and_spares_the_parent() -> None:
    """A sub-group closed while one of its collectives runs here: that call fails at once
    with GroupBrokenError (it used to run on, or wait out its timeout and blame a healthy
    peer), the other member's part fails soon after, naming this rank, and the parent
    group goes on. ``async with`` works on a sub-group (it used to say 'already
    started')."""
    from p2pdist import GroupBrokenError

    async with groups(2, timeout=30) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        a, b = subs
        assert a is not None and b is not None
        pending = asyncio.create_task(a.all_reduce(np.ones(4)))
        await asyncio.sleep(0.05)
        async with a:  # entering a started sub-group is fine; leaving it closes it
            pass
        with pytest.raises(GroupBrokenError, match="the group was closed"):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(ConnectionBrokenError, match=r"rank 0 \(") as info:
            await asyncio.wait_for(b.all_reduce(np.ones(4)), 5)
        assert "left the group" in str(info.value)
        with pytest.raises(GroupBrokenError, match="closed"):
            await a.all_reduce(np.ones(4))
        got = await asyncio.gather(*(g.all_reduce(np.ones(2), timeout=5) for g in gs))
        np.testing.assert_array_equal(got[0], [2.0, 2.0])


async def test_a_collective_running_when_its_group_closes_says_so() -> None:
    """The root group closed while one of its collectives runs here: the call said
    "connection to rank 2 (...) was closed locally", naming a healthy peer; now it says
    the group was closed (as a sub-group's call does)."""
    from p2pdist import GroupBrokenError

    async with groups(3, timeout=30) as gs:
        pending = asyncio.create_task(gs[0].all_reduce(np.ones(1 << 16)))
        await asyncio.sleep(0.05)  # rank 0 waits for ranks 1 and 2, which have not called
        await gs[0].close()
        with pytest.raises(GroupBrokenError, match="the group was closed") as info:
            await asyncio.wait_for(pending, 5)
        assert "rank 2" not in str(info.value) and "rank 1" not in str(info.value)


async def test_out_may_hold_the_input_only_as_a_whole_row_and_is_checked_everywhere() -> None:
    """all_gather and gather take their input in place as a row of out (as NCCL's
    in-place all-gather) and refuse any other overlap; reduce and gather check out= on
    every rank, not only on dst (a wrong one was ignored elsewhere)."""
    async with groups(2) as gs:
        outs = [np.zeros((2, 3)) for _ in gs]
        for r in range(2):
            outs[r][r] = r + 1.0
        got = await asyncio.gather(
            *(g.all_gather(outs[g.rank][g.rank], out=outs[g.rank]) for g in gs)
        )
        for r in range(2):
            assert got[r] is outs[r]
            np.testing.assert_array_equal(outs[r], [[1.0] * 3, [2.0] * 3])
        straddling = outs[0].reshape(-1)[1:4]  # the end of row 0 and the start of row 1
        with pytest.raises(UsageError, match="one whole row"):
            await gs[0].all_gather(straddling, out=outs[0])
        with pytest.raises(UsageError, match="one whole row"):
            await gs[1].gather(outs[1].reshape(-1)[2:5], 1, out=outs[1])
        with pytest.raises(UsageError, match="out has int8"):
            await gs[1].reduce(np.ones(3), 0, out=np.zeros(7, np.int8))
        with pytest.raises(UsageError, match="out has int8"):  # gather too, off dst
            await gs[1].gather(np.ones(3), 0, out=np.zeros((7, 4), np.int8))


async def test_a_closed_group_or_sub_group_says_it_is_closed_when_entered_again() -> None:
    """``async with`` (or start()) on a closed group said "group already started"; the
    message that says what to do could never be reached (an audit)."""
    async with groups(2, timeout=30) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        sub = subs[0]
        assert sub is not None
        await asyncio.gather(*(s.close() for s in subs if s is not None))
        with pytest.raises(UsageError, match=r"sub-group is closed; split\(\) makes a new one"):
            async with sub:
                pass
    with pytest.raises(UsageError, match="group is closed; make a new Group"):
        await gs[0].start()


async def test_a_subgroup_closed_on_one_rank_has_it_leave_for_the_others() -> None:
    """Rank 2 closes its sub-group while idle: for ranks 0 and 1 it has left that
    sub-group, so their later calls on it fail at once naming it (they used to wait out
    the timeout, and the timeout then broke the root group on every rank); a call they
    have running on it fails too; the parent is untouched."""

    async with groups(3, timeout=30) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert all(s is not None for s in subs)
        running = asyncio.create_task(subs[0].all_reduce(np.ones(3)))  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
        await subs[2].close()  # type: ignore[union-attr]
        with pytest.raises(ConnectionBrokenError, match=r"rank 2 \(.*closed the sub-group"):
            await asyncio.wait_for(running, 5)
        with pytest.raises(ConnectionBrokenError, match=r"rank 2 \(.*closed the sub-group"):
            await asyncio.wait_for(subs[1].all_reduce(np.ones(3)), 5)  # type: ignore[union-attr]
        got = await asyncio.gather(*(g.all_reduce(np.ones(2), timeout=5) for g in gs))
        np.testing.assert_array_equal(got[0], [3.0, 3.0])
        assert all(g.broken is None for g in gs)


async def test_a_split_that_failed_on_one_member_leaves_no_half_made_subgroup() -> None:
    """Rank 2 closes its sub-group while a split of it is under way there, after its
    rows of the split went out. Ranks 0 and 1 have every row, so their split returns a
    sub-group with rank 2 in it, a sub-group rank 2 never made: their calls on it used to
    wait for rank 2 until the timeout, which then broke the root group on every rank.
    The call-failed notice rank 2 sends for the split now marks that sub-group unmade by
    rank 2: calls on it fail at once naming it and why, and the root group goes on."""
    async with groups(3, timeout=6) as gs:
        subs = [s for s in await asyncio.gather(*(g.split(0) for g in gs)) if s is not None]
        assert len(subs) == 3
        closer: list[asyncio.Task[None]] = []
        slowed = contextlib.ExitStack()

        def in_the_second_round(rank: int) -> None:
            """In the split's second round (the confirmations), rank 2 closes its
            sub-group 0.1 s after its own went out, while what ranks 0 and 1 send it
            takes 0.5 s: it closes before it has theirs, and they have all of its."""
            exchange = subs[rank]._split_exchange
            rounds = 0

            async def second_round(lk: Any, row: np.ndarray) -> np.ndarray:
                nonlocal rounds
                rounds += 1
                if rounds == 2 and rank == 2:
                    asyncio.get_running_loop().call_later(
                        0.1, lambda: closer.append(asyncio.ensure_future(subs[2].close()))
                    )
                elif rounds == 2:
                    slowed.enter_context(slow_link(gs[rank], 2, 0.5, space=subs[rank]._space))
                return await exchange(lk, row)

            subs[rank]._split_exchange = second_round  # type: ignore[method-assign]

        for rank in range(3):
            in_the_second_round(rank)
        with slowed:
            got = await asyncio.gather(*(s.split(0) for s in subs), return_exceptions=True)
            await asyncio.gather(*closer)
        assert isinstance(got[2], GroupBrokenError), got
        for rank in (0, 1):
            child = got[rank]
            assert isinstance(child, Group) and child.size == 3, got
            with pytest.raises(ConnectionBrokenError, match=r"rank 2 \(.*split.*failed there"):
                await asyncio.wait_for(child.all_reduce(np.ones(3)), 3)
            with pytest.raises(ConnectionBrokenError, match=r"rank 2 \(.*split.*failed there"):
                await asyncio.wait_for(child.send(np.ones(3), 2), 3)
        got = await asyncio.gather(*(g.all_reduce(np.ones(2), timeout=5) for g in gs))
        np.testing.assert_array_equal(got[0], [3.0, 3.0])
        assert all(g.broken is None for g in gs)


async def test_closing_a_subgroup_ends_its_point_to_point_traffic_too() -> None:
    """Closing a sub-group did nothing to its sends and recvs: the closing rank's own
    pending recv stayed open (it returned a message sent after the close), the peer's
    recv from it waited out the timeout, the peer's sends to it "succeeded", and what
    they carried stayed queued on the shared root connection for good (with a small
    max_buffered, reading paused there and the root group's all_reduce timed out: an
    audit). A message sent before the close is still received."""
    async with groups(2, timeout=10, max_buffered=8 << 20) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        s0, s1 = subs
        assert s0 is not None and s1 is not None
        await s0.send(np.arange(3.0), 1)  # before the close: still received
        waiting = asyncio.create_task(s1.recv(0, like=np.zeros(3)))

        async def send_unread() -> None:  # 16 MiB each, past max_buffered: blocks
            # (8 of them: the kernel's receive buffer alone may grow to 32 MiB, and one
            # frame past max_buffered is taken in whole before reading pauses.)
            for _ in range(8):
                await s1.send(np.zeros(2 << 20), 0)

        sending = asyncio.create_task(send_unread())
        await asyncio.sleep(0.2)
        assert not sending.done()
        await s0.close()
        np.testing.assert_array_equal(await asyncio.wait_for(waiting, 5), np.arange(3.0))
        # What was queued is dropped, so the blocked send goes on, and a send after
        # the close notice fails saying why.
        ended = await asyncio.wait_for(asyncio.gather(sending, return_exceptions=True), 5)
        assert ended[0] is None or "closed the sub-group" in str(ended[0]), ended
        with pytest.raises(ConnectionBrokenError, match=r"rank 0 \(.*closed the sub-group"):
            await asyncio.wait_for(s1.recv(0), 5)  # nothing more comes from it
        with pytest.raises(ConnectionBrokenError, match=r"rank 0 \(.*closed the sub-group"):
            await asyncio.wait_for(s1.send(np.ones(3), 0), 5)
        conn = gs[0]._conns[1]
        await asyncio.sleep(0.2)
        assert conn.stats.buffered < 1 << 20, conn.stats  # the 128 MiB were dropped
        got = await asyncio.gather(*(g.all_reduce(np.ones(2), timeout=5) for g in gs))
        np.testing.assert_array_equal(got[0], [2.0, 2.0])
        # The closing rank's own recv under way fails at once, saying why.
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        assert subs[0] is not None
        pending = asyncio.create_task(subs[0].recv(1))
        await asyncio.sleep(0.05)
        await subs[0].close()
        with pytest.raises(GroupBrokenError, match=r"recv from rank 1 \(.*the group was closed"):
            await asyncio.wait_for(pending, 5)
        assert all(g.broken is None for g in gs)


async def test_a_send_cut_by_its_subgroups_close_is_a_closed_subgroup_to_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 closes its sub-group in the middle of a send of many pieces: its cut send
    says "stopped sending" after the close notice, and rank 1's recv raised that plain
    PeerError, or "closed the sub-group", depending on which it read first (a review)."""
    monkeypatch.setattr(p2p_module, "CHUNK", 1 << 20)
    async with groups(2, timeout=10, max_buffered=2 << 20) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))
        s0, s1 = subs
        assert s0 is not None and s1 is not None
        sending = asyncio.create_task(s0.send(np.zeros(4 << 20), 1))  # 32 pieces
        await asyncio.sleep(0.2)
        assert not sending.done()  # rank 1 reads nothing yet: it waits on the link
        await s0.close()
        with pytest.raises(GroupBrokenError, match="the group was closed"):
            await asyncio.wait_for(sending, 5)
        with pytest.raises(ConnectionBrokenError, match=r"rank 0 \(.*closed the sub-group"):
            await asyncio.wait_for(s1.recv(0), 5)
        assert all(g.broken is None for g in gs)


async def test_closing_a_subgroup_right_after_its_last_call_lets_slower_ranks_finish() -> None:
    """Each rank closes the sub-group as soon as its all_reduce returns; rank 2's
    messages to rank 1 come 50 ms late, so rank 1 is still in the call when rank 0's
    close notice arrives. The call rank 0 took part in still finishes on rank 1 (it
    failed there, naming rank 0 as gone); a later call is refused naming the closer;
    the root group is untouched. profile_links (which splits and closes) too."""
    async with groups(3, timeout=10) as gs:
        subs = await asyncio.gather(*(g.split(0) for g in gs))

        async def call_then_close(s: Group | None) -> np.ndarray:
            assert s is not None
            try:
                return await s.all_reduce(np.ones(4))
            finally:
                await s.close()

        with slow_link(gs[2], 1, 0.05):
            got = await asyncio.gather(*(call_then_close(s) for s in subs))
            assert all(g.tolist() == [3.0] * 4 for g in got)
            profiles = await asyncio.gather(*(g.profile_links(repeats=1) for g in gs))
            assert all(len(p) == 3 for p in profiles)
        assert all(g.broken is None for g in gs)


async def test_a_close_notice_that_comes_before_the_split_returns_is_kept() -> None:
    """Rank 1 closes its new sub-group at once; rank 2's last split message to rank 0 is
    late, so rank 1's close notice reaches rank 0 before rank 0's split returns: it must
    still count (it was dropped, and rank 0's next call waited out the timeout, which
    then broke the root group on every rank)."""
    async with groups(3, timeout=10) as gs:

        async def split(r: int) -> Group | None:
            sub = await gs[r].split(0)
            if r == 1 and sub is not None:
                await sub.close()
            return sub

        with slow_link(gs[2], 0, 0.3, space=0):
            subs = await asyncio.gather(*(split(r) for r in range(3)))
        sub0 = subs[0]
        assert sub0 is not None
        with pytest.raises(ConnectionBrokenError, match=r"rank 1 \(.*closed the sub-group"):
            await asyncio.wait_for(sub0.all_reduce(np.ones(3)), 5)
        assert all(g.broken is None for g in gs)


async def test_an_all_none_split_on_a_rank_out_of_spaces_fails_on_every_rank() -> None:
    async with groups(3, timeout=5) as gs:
        gs[0]._spaces.next = 0xFE00 - 2  # rank 0 has used (almost) every channel space
        results = await asyncio.gather(*(g.split(None) for g in gs), return_exceptions=True)
        assert results == [None, None, None]
        results = await asyncio.gather(*(g.split(None) for g in gs), return_exceptions=True)
        assert all(isinstance(r, UsageError) for r in results), results
        assert all(g.broken is None for g in gs)


@pytest.mark.parametrize("world", [2, 4])
async def test_every_collective_started_at_once(world: int) -> None:
    async with groups(world) as gs:
        await every_collective_at_once(gs)
        await every_collective_at_once(gs)  # the group goes on after the batch


async def test_many_collectives_in_flight_past_the_buffer_limit_do_not_wait_for_good() -> None:
    """48 all-reduces of 4 MiB in flight at once on three ranks with 16 MiB max_buffered
    timed out (found by an audit: 1,300 of 2 MiB at the default 512 MiB did too): every
    call sends before it receives, so each rank blocked in a send while its own reading
    had paused, its mailbox full of frames for its calls still sending. While a sender
    of the group waits, its connections read on to four times max_buffered. 96 calls
    went past that and timed out, saying reading was paused; since concurrent senders
    take turns for a backed-up connection (each hands over its frame as the pipe drains,
    not all at once), they complete too. (The timeout's word on paused reading is tested
    with all_to_all_v below.)"""
    mib = 1 << 20
    config = {"algorithm": "ring"}
    async with groups(3, timeout=20.0, max_buffered=16 * mib, config=config) as gs:

        async def many(g: Group, calls: int) -> bool:
            xs = [np.full(mib, 1.0, np.float32) for _ in range(calls)]
            await asyncio.gather(*(g.all_reduce(x, out=x) for x in xs))
            return all(x[0] == 3.0 and x[-1] == 3.0 for x in xs)

        got = await asyncio.wait_for(asyncio.gather(*(many(g, 48) for g in gs)), 60)
        assert got == [True] * 3
        got = await asyncio.wait_for(asyncio.gather(*(many(g, 96) for g in gs)), 60)
        assert got == [True] * 3


async def test_all_to_all_of_blocks_beyond_the_buffer_limit() -> None:
    """all_to_all sends every block before it receives one: with blocks of 130 MiB and
    2 MiB max_buffered (or past 512 MiB at the default) both ranks blocked in their
    sends with reading paused, until the timeout. Its blocks land in the places named
    for them, which take none of the connection's memory and no longer count.
    all_to_all_v's pieces (a row count, then the rows, sent together so that a rank
    behind in its calls finds them in call order) cannot be named before they come:
    past four times max_buffered they still stall, and the timeout says why."""
    n = (130 << 20) // 4
    async with groups(2, timeout=8.0, max_buffered=2 << 20) as gs:

        async def one(g: Group) -> float:
            x = np.full((2, n), float(g.rank), np.float32)
            got = await g.all_to_all(x)
            return float(got[1 - g.rank][-1])

        assert await asyncio.wait_for(asyncio.gather(*(one(g) for g in gs)), 30) == [1.0, 0.0]
    async with groups(2, timeout=3.0, max_buffered=2 << 20) as gs:

        async def one_v(g: Group) -> None:
            x = np.full((2, n), float(g.rank), np.float32)
            await g.all_to_all_v([x[0], x[1]])

        results = await asyncio.wait_for(
            asyncio.gather(*(one_v(g) for g in gs), return_exceptions=True), 30
        )
        told = [str(e) for e in results if isinstance(e, PeerTimeoutError)]
        assert any(" is paused: " in t and "max_buffered" in t for t in told), results


async def test_a_paused_connection_reads_on_to_the_higher_limit_once_a_sender_waits() -> None:
    """Reading from rank 1 paused (rank 0 does not take its messages yet); then a send
    of rank 0 to rank 2 waits (rank 2 does not read yet): the paused connection reads on
    to four times max_buffered, no further, and everything arrives in the end."""
    from transport_conformance import wait_until

    mib = 1 << 20
    async with groups(3, timeout=20.0, max_buffered=mib, write_buffer_high=mib) as gs:
        pieces = [np.full(mib // 4, float(i), np.float32) for i in range(12)]
        from_one = asyncio.gather(*(gs[1].send(p, 0) for p in pieces))
        conn = gs[0].connection(1)
        await wait_until(lambda: conn.stats.reading_paused, "reading from rank 1 paused")
        held = conn.stats.buffered
        assert held <= 2 * mib + mib + 4096, held  # twice max_buffered (and a frame)
        big = np.ones(mib, np.float32)

        async def send_to_two() -> None:  # the second send waits: rank 2 reads nothing
            for _ in range(8):
                await gs[0].send(big, 2)

        to_two = asyncio.ensure_future(send_to_two())
        await wait_until(lambda: conn.stats.buffered > held + mib // 2, "reading on")
        assert conn.stats.buffered <= 4 * mib + mib + 4096, conn.stats.buffered
        for _ in range(8):
            got = await asyncio.wait_for(gs[2].recv(0, like=big), 20)
            assert got[0] == 1.0 and got[-1] == 1.0
        await asyncio.wait_for(to_two, 20)
        for i in range(12):
            x = await asyncio.wait_for(gs[0].recv(1, like=pieces[0]), 20)
            assert x[0] == float(i)
        await asyncio.wait_for(from_one, 20)
