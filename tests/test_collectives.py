"""Collectives against numpy over real loopback sockets, world sizes 1..6."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from group_helpers import groups, until_left

from p2pdist import (
    Group,
    GroupBrokenError,
    GroupConfig,
    MismatchError,
    RemoteProtocolError,
    UsageError,
)
from p2pdist.transport.base import TransportConfig
from p2pdist.wire.frames import FrameLimits

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]


def make_input(rank: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s deterministic input (small values, so int sums do not overflow)."""
    rng = np.random.default_rng(1000 * seed + rank)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if np.dtype(dtype).kind in "iu":
        return np.asarray(rng.integers(0, 4, size=shape), dtype=dtype)
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """Rank-order reduction in the input dtype (the order the direct algorithm uses)."""
    fn = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
    acc = inputs[0].copy()
    for x in inputs[1:]:
        fn[op](acc, x, out=acc)
    if op == "mean":
        np.divide(acc, acc.dtype.type(len(inputs)), out=acc)
    return acc


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.dtype(dtype).kind == "f":
        tol = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)
    else:
        np.testing.assert_array_equal(got, want)


async def run_all(gs: list[Group], fn: Any) -> list[Any]:
    return list(await asyncio.gather(*(fn(g) for g in gs)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6])
async def test_all_reduce_every_dtype_and_world(world: int) -> None:
    async with groups(world) as gs:
        for dtype in DTYPES:
            for shape in [(), (1,), (7, 3), (world - 1 if world > 1 else 0,), (40_000,)]:
                ops = ["sum", "max", "min"] + (["mean"] if np.dtype(dtype).kind == "f" else [])
                for op in ops:
                    xs = [make_input(r, shape, dtype) for r in range(world)]
                    outs = await run_all(gs, lambda g, xs=xs, op=op: g.all_reduce(xs[g.rank], op))
                    assert_close(outs[0], reference(xs, op), dtype)
                    for o in outs[1:]:
                        assert o.tobytes() == outs[0].tobytes()  # bitwise identical on all ranks


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 1000, 300_001])
async def test_ring_and_direct_paths_all_ops(world: int, n: int) -> None:
    async with groups(world) as gs:
        for op, dtype in [
            ("sum", "float32"),
            ("prod", "float64"),
            ("max", "int32"),
            ("min", "int64"),
            ("mean", "float64"),
            ("sum", "int8"),
        ]:
            xs = [make_input(r, (n,), dtype, seed=n) for r in range(world)]
            if op == "prod":
                xs = [1 + 0.01 * x for x in xs]
            outs = await run_all(gs, lambda g, xs=xs, op=op: g.all_reduce(xs[g.rank], op))
            assert_close(outs[0], reference(xs, op), dtype)
            assert len({o.tobytes() for o in outs}) == 1


async def test_out_in_place_and_non_contiguous() -> None:
    async with groups(3) as gs:
        base = [make_input(r, (64, 2000), "float32") for r in range(3)]
        views = [b[::2, ::3] for b in base]  # non-contiguous
        assert not views[0].flags.c_contiguous
        outs = await run_all(gs, lambda g: g.all_reduce(views[g.rank]))
        assert_close(outs[0], reference([np.ascontiguousarray(v) for v in views], "sum"), "float32")
        # in place: out is the input itself
        xs = [make_input(r, (50_000,), "float64") for r in range(3)]
        want = reference(xs, "sum")
        bufs = [x.copy() for x in xs]
        res = await run_all(gs, lambda g: g.all_reduce(bufs[g.rank], out=bufs[g.rank]))
        for r in range(3):
            assert res[r] is bufs[r]
            np.testing.assert_allclose(bufs[r], want, rtol=1e-12)
        # out separate from the input; the input is left alone
        outs2 = [np.empty(50_000) for _ in range(3)]
        await run_all(gs, lambda g: g.all_reduce(xs[g.rank], op="max", out=outs2[g.rank]))
        np.testing.assert_array_equal(outs2[1], np.maximum.reduce(xs))
        np.testing.assert_array_equal(xs[0], make_input(0, (50_000,), "float64"))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("rows", [0, 1, 5, 4096])
async def test_reduce_scatter_matches_array_split(world: int, rows: int) -> None:
    async with groups(world) as gs:
        for dtype in ["float32", "int32"]:
            xs = [make_input(r, (rows, 3), dtype) for r in range(world)]
            full = reference(xs, "sum")
            outs = await run_all(gs, lambda g, xs=xs: g.reduce_scatter(xs[g.rank]))
            for r, piece in enumerate(outs):
                assert_close(piece, np.array_split(full, world)[r], dtype)


@pytest.mark.parametrize("world", [1, 2, 4, 5])
@pytest.mark.parametrize("shape", [(), (0,), (3, 2), (70_000,)])
async def test_all_gather_and_broadcast(world: int, shape: tuple[int, ...]) -> None:
    async with groups(world) as gs:
        xs = [make_input(r, shape, "float32") for r in range(world)]
        outs = await run_all(gs, lambda g: g.all_gather(xs[g.rank]))
        for o in outs:
            np.testing.assert_array_equal(o, np.stack(xs))
        src = world - 1
        blank = np.zeros(shape, np.float32)
        res = await run_all(gs, lambda g: g.broadcast(xs[src] if g.rank == src else blank, src))
        for o in res:
            np.testing.assert_array_equal(o, xs[src])
        await run_all(gs, lambda g: g.barrier())


async def test_tls_group_collectives() -> None:
    async with groups(3, tls=True) as gs:
        xs = [make_input(r, (200_000,), "float32") for r in range(3)]
        outs = await run_all(gs, lambda g: g.all_reduce(xs[g.rank]))
        np.testing.assert_allclose(outs[2], reference(xs, "sum"), rtol=1e-5, atol=1e-5)
        conn = gs[0].connection(1)
        assert getattr(conn, "encrypted", False)


async def test_send_recv_and_mismatch_keeps_link_usable() -> None:
    async with groups(2) as gs:
        a, b = gs
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        big = np.arange(3_000_000, dtype=np.int64)
        await asyncio.gather(a.send(x, 1), a.send(big, 1))
        got = await b.recv(0, like=x)
        np.testing.assert_array_equal(got, x)
        got_big = await b.recv(0, dtype=np.int64, shape=big.shape)
        np.testing.assert_array_equal(got_big, big)
        # mismatch: clear error naming the sender, then the link still works
        await a.send(x.astype(np.float64), 1)
        with pytest.raises(MismatchError) as info:
            await b.recv(0, like=x)
        assert "rank 0" in str(info.value) and "float64" in str(info.value)
        await a.send(x, 1)
        out = np.empty_like(x)
        res = await b.recv(0, out=out)
        assert res is out
        np.testing.assert_array_equal(out, x)
        # the group still runs collectives after the p2p mismatch
        outs = await run_all(gs, lambda g: g.all_reduce(np.ones(3)))
        np.testing.assert_array_equal(outs[0], [2, 2, 2])


async def test_collective_mismatch_is_detected_and_named() -> None:
    async with groups(3) as gs:

        async def call(g: Group) -> Any:
            shape = (5,) if g.rank != 2 else (6,)
            return await g.all_reduce(np.ones(shape, np.float32), timeout=5)

        results = await asyncio.gather(*(call(g) for g in gs), return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results)
        text = " ".join(str(r) for r in results)
        assert "rank 2" in text and "float32[6]" in text
        assert any(isinstance(r, MismatchError) for r in results)


async def test_a_call_in_flight_beside_a_mismatch_fails_as_broken_not_as_that_mismatch() -> None:
    """A barrier in flight beside an all_reduce whose ranks disagree: the all_reduce's
    MismatchError broke the group and woke every wait on the connections with itself,
    so the barrier raised the all_reduce's MismatchError (the very object), as if the
    barrier had mismatched (an audit). It is a GroupBrokenError now, naming its own
    call, with the all_reduce's error as its cause."""
    async with groups(3) as gs:

        async def calls(g: Group) -> list[Any]:
            if g.rank == 2:
                await asyncio.sleep(0.3)  # ranks 0 and 1 wait in both calls
            dtype = np.float64 if g.rank == 1 else np.float32
            both = [g.barrier(timeout=5), g.all_reduce(np.ones(4, dtype), timeout=5)]
            return list(await asyncio.gather(*both, return_exceptions=True))

        results = await asyncio.gather(*(calls(g) for g in gs))
        for barrier, reduced in results[:2]:
            assert isinstance(reduced, MismatchError), reduced
            assert isinstance(barrier, GroupBrokenError), barrier
            assert str(barrier).startswith("barrier() failed: "), barrier
            assert barrier.cause is reduced


async def test_a_garbled_stream_under_a_collective_is_its_protocol_error() -> None:
    """The connection's own protocol error breaks the group before the waiting call
    sees it: the call still raises it as is (a first version of the test above wrapped
    it as if another call had failed: a reviewer)."""
    async with groups(2, timeout=5) as gs:
        call = asyncio.create_task(gs[1].all_reduce(np.ones(4)))
        await asyncio.sleep(0.2)  # rank 1 waits for rank 0's part
        gs[0].connection(1)._transport.write(b"\xff" * 64)  # type: ignore[attr-defined]
        with pytest.raises(RemoteProtocolError, match=r"rank 0 .*frame version"):
            await asyncio.wait_for(call, 8)


async def test_a_mismatch_told_by_another_rank_names_that_rank() -> None:
    """In a ring only rank 2's neighbours see its call; the others learn of it from
    their abort notice, whose text said "but this rank called": the teller, read as the
    reader."""
    async with groups(4, config={"algorithm": "ring"}) as gs:

        async def call(g: Group) -> Any:
            x = np.ones(100_000, np.float64 if g.rank == 2 else np.float32)
            return await g.all_reduce(x, timeout=5)

        results = await asyncio.gather(*(call(g) for g in gs), return_exceptions=True)
        _check_told_by_name(results)
    # In a sub-group numbered the other way round, ranks are named by their root numbers
    # all the same (the notice named the teller by its sub-group number).
    async with groups(4, config={"algorithm": "ring"}) as gs:
        subs = await asyncio.gather(*(g.split(0, key=-g.rank) for g in gs))

        async def sub_call(sub: Group | None, rank: int) -> Any:
            assert sub is not None
            x = np.ones(100_000, np.float64 if rank == 2 else np.float32)
            return await sub.all_reduce(x, timeout=5)

        results = await asyncio.gather(
            *(sub_call(s, g.rank) for s, g in zip(subs, gs, strict=True)), return_exceptions=True
        )
        _check_told_by_name(results)


def _check_told_by_name(results: list[Any]) -> None:
    told = [r for r in results if "aborted the group" in str(r)]
    assert told, results
    for r in told:
        assert isinstance(r, GroupBrokenError) and "this rank" not in str(r), r
        teller = str(r).split(" aborted the group")[0].split(": ")[-1]
        assert f"but {teller} called" in str(r), r


async def test_concurrent_collectives_from_several_tasks() -> None:
    async with groups(3) as gs:
        arrays = [
            [make_input(r, (n,), "float64", seed=n) for r in range(3)] for n in (10, 90_000, 7)
        ]

        async def many(g: Group) -> list[np.ndarray]:
            tasks = [asyncio.create_task(g.all_reduce(arrays[i][g.rank])) for i in range(3)]
            return list(await asyncio.gather(*tasks))

        outs = await run_all(gs, many)
        for i in range(3):
            want = reference(arrays[i], "sum")
            for r in range(3):
                np.testing.assert_allclose(outs[r][i], want, rtol=1e-12)


async def test_usage_errors_are_clear() -> None:
    async with groups(2) as gs:
        g = gs[0]
        with pytest.raises(UsageError, match="unknown op"):
            await g.all_reduce(np.ones(3), op="avg")
        with pytest.raises(UsageError, match="floating"):
            await g.all_reduce(np.ones(3, np.int32), op="mean")
        with pytest.raises(UsageError, match="out has"):
            await g.all_reduce(np.ones(3), out=np.ones(4))
        with pytest.raises(UsageError, match="cannot travel"):
            await g.all_reduce(np.array(["a", "b"], dtype=object))
        with pytest.raises(UsageError, match="src"):
            await g.broadcast(np.ones(3), src=5)
        with pytest.raises(UsageError, match="dst"):
            await g.send(np.ones(3), 0)
    with pytest.raises(UsageError):
        Group.from_seed("test-seed-0123456789", rank=3, world=2, peers=["a:1", "b:2"])
    with pytest.raises(UsageError, match="one address per rank"):
        Group.from_seed("test-seed-0123456789", rank=0, world=2, peers=["a:1"])
    # Found when the group is made, not after a connect_timeout spent waiting for a rank
    # that cannot come (and blamed on the wrong address).
    seed = "test-seed-0123456789"
    with pytest.raises(UsageError, match=r"rank 1 and rank 2 both have 'B:2' in peers"):
        Group.from_seed(seed, rank=0, world=3, peers=["a:1", "b:2", "B:2"])
    with pytest.raises(UsageError, match=r"peers entry of rank 1: address 'nope' is not"):
        Group.from_seed(seed, rank=0, world=2, peers=["a:1", "nope"])
    Group.from_seed(seed, rank=0, world=2, peers=["a:1", "a:2"])  # one host, two ports
    with pytest.raises(UsageError, match=r"listen=: address 'garbage' is not host:port"):
        Group.from_seed(seed, rank=0, world=2, peers=["a:1", "a:2"], listen="garbage")
    # (neither peers nor relay: the ranks are found on the local network, test_discovery.py)


async def test_size_one_group_is_identity_without_network() -> None:
    async with Group.from_seed("test-seed-0123456789", rank=0, world=1) as g:
        x = np.arange(6.0).reshape(2, 3)
        np.testing.assert_array_equal(await g.all_reduce(x, op="mean"), x)
        np.testing.assert_array_equal(await g.all_gather(x), x[None])
        np.testing.assert_array_equal(await g.reduce_scatter(x), x)
        np.testing.assert_array_equal(await g.broadcast(x, 0), x)
        await g.barrier()
        # A bad timeout is refused as at any other world, though nothing would wait.
        one = np.ones(3)
        calls = {
            "all_reduce": lambda t: g.all_reduce(one, timeout=t),
            "reduce_scatter": lambda t: g.reduce_scatter(one, timeout=t),
            "all_gather": lambda t: g.all_gather(one, timeout=t),
            "broadcast": lambda t: g.broadcast(one, 0, timeout=t),
            "barrier": lambda t: g.barrier(timeout=t),
            "reduce": lambda t: g.reduce(one, 0, timeout=t),
            "gather": lambda t: g.gather(one, 0, timeout=t),
            "scatter": lambda t: g.scatter([one], 0, timeout=t),
            "all_to_all": lambda t: g.all_to_all(one[None], timeout=t),
            "all_to_all_v": lambda t: g.all_to_all_v([one], timeout=t),
            "split": lambda t: g.split(0, timeout=t),
        }
        for call in calls.values():
            with pytest.raises(UsageError, match="timeout must be a positive"):
                await call(-1)
            await call(5.0)  # and the same call with a good one works


async def test_a_bad_timeout_is_the_callers_error_even_in_a_broken_group() -> None:
    """Every rank passed timeout=0: the first to fail left the group over it, and a
    slower rank then got "rank 1 left the group" instead of its own mistake (the group's
    state was checked before the call's timeout)."""
    async with groups(2) as gs:
        a, b = gs
        await b.close()  # a rank that left the group, whatever its reason
        await until_left([a], 1)
        one = np.ones(3)
        calls = {
            "all_reduce": lambda: a.all_reduce(one, timeout=0),
            "reduce_scatter": lambda: a.reduce_scatter(np.ones(4), timeout=0),
            "all_gather": lambda: a.all_gather(one, timeout=0),
            "broadcast": lambda: a.broadcast(one, 0, timeout=0),
            "barrier": lambda: a.barrier(timeout=0),
            "reduce": lambda: a.reduce(one, 0, timeout=0),
            "gather": lambda: a.gather(one, 0, timeout=0),
            "scatter": lambda: a.scatter([one, one], 0, timeout=0),
            "all_to_all": lambda: a.all_to_all(np.ones((2, 3)), timeout=0),
            "all_to_all_v": lambda: a.all_to_all_v([one, one], timeout=0),
            "split": lambda: a.split(0, timeout=0),
        }
        for name, call in calls.items():
            with pytest.raises(UsageError, match="timeout must be a positive"):
                await call()
            with pytest.raises(GroupBrokenError):  # the group's state, once the call is right
                await (a.split(0, timeout=5) if name == "split" else a.barrier(timeout=5))


async def test_a_refused_timeout_leaves_the_sequence_in_step() -> None:
    """A call refused for its timeout takes no collective or p2p slot on that rank, so the
    next calls still pair up with the other ranks' (instead of hanging until a timeout)."""
    async with groups(2) as gs:
        a, b = gs
        with pytest.raises(UsageError, match="timeout"):
            await a.all_reduce(np.ones(3), timeout=0)
        with pytest.raises(UsageError, match="timeout"):
            await a.send(np.ones(3), 1, timeout=-1)
        with pytest.raises(UsageError, match="timeout"):
            await b.recv(0, timeout=0)
        for unbounded in (float("nan"), float("inf")):  # a NaN deadline was never enforced
            with pytest.raises(UsageError, match="finite"):
                await a.all_reduce(np.ones(3), timeout=unbounded)
        with pytest.raises(ValueError, match="finite"):
            GroupConfig(timeout=float("nan"))
        with pytest.raises(ValueError, match="max_payload must be at least 67108864"):
            GroupConfig(transport=TransportConfig(limits=FrameLimits(max_payload=1 << 20)))
        outs = await run_all(gs, lambda g: g.all_reduce(np.ones(3), timeout=5))
        np.testing.assert_array_equal(outs[0], [2, 2, 2])
        x = np.arange(4.0)
        got = await asyncio.gather(a.send(x, 1, timeout=5), b.recv(0, like=x, timeout=5))
        np.testing.assert_array_equal(got[1], x)


async def test_recv_without_out_returns_the_received_buffer_and_keeps_it() -> None:
    """``recv`` without ``out=`` returns a view of the message's own receive buffer (no
    copy); it stays the caller's: later messages of the same size never land in it."""
    async with groups(2) as gs:
        a, b = gs
        first = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: a pooled receive buffer
        await a.send(first, 1)
        got = await b.recv(0, like=first)
        assert not got.flags.owndata and got.flags.writeable
        for k in range(4):
            await a.send(first + k + 1, 1)
            later = await b.recv(0, like=first)
            np.testing.assert_array_equal(later, first + k + 1)
            del later
        np.testing.assert_array_equal(got, first)


async def test_recv_of_a_single_frame_that_does_not_match_its_header() -> None:
    """A one-frame array message whose payload is not the size its header says is a
    protocol error naming the sender, not a wrong array."""
    import msgpack

    from p2pdist.transport.mailbox import SPACE_SHIFT
    from p2pdist.wire.arrays import ArrayHeader

    async with groups(2) as gs:
        a, b = gs
        header = ArrayHeader.of(np.zeros(10, np.float32))
        meta = bytes(msgpack.packb([header.to_wire(), 1], use_bin_type=True))
        channel = (b._p2p_space << SPACE_SHIFT) | 0  # type: ignore[attr-defined]
        await a.connection(1).send(channel, b"\0" * 36, meta=meta)
        with pytest.raises(RemoteProtocolError, match="rank 0"):
            await b.recv(0)


async def test_recv_arguments_are_checked_before_anything_is_taken() -> None:
    async with groups(2) as gs:
        a, b = gs
        bad: list[dict[str, object]] = [
            {"out": [0.0, 0.0]},
            {"shape": "3"},
            {"shape": (2, -1)},
            {"dtype": "junk"},
        ]
        for kwargs in bad:
            with pytest.raises(UsageError):
                await b.recv(0, **kwargs)  # type: ignore[arg-type]
        x = np.arange(3.0)
        # like= may be a list, and shape= an int, as in numpy: the next message pairs up
        got = await asyncio.gather(a.send(x, 1), b.recv(0, like=[0.0, 0.0, 0.0]))
        np.testing.assert_array_equal(got[1], x)
        got = await asyncio.gather(a.send(x, 1), b.recv(0, shape=3, dtype=np.float64))
        np.testing.assert_array_equal(got[1], x)


def test_from_env_refuses_peers_and_a_relay_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to take the relay and drop the peers without a word."""
    monkeypatch.setenv("P2PDIST_SEED", "a-seed-of-enough-bytes")
    monkeypatch.setenv("P2PDIST_RANK", "0")
    monkeypatch.setenv("P2PDIST_WORLD", "2")
    monkeypatch.setenv("P2PDIST_PEERS", "127.0.0.1:1,127.0.0.1:2")
    monkeypatch.setenv("P2PDIST_RELAY", "https://127.0.0.1:9/?pin=" + "a" * 52)
    with pytest.raises(UsageError, match="both P2PDIST_PEERS and P2PDIST_RELAY"):
        Group.from_env()
    monkeypatch.delenv("P2PDIST_RELAY")
    assert Group.from_env().size == 2  # made, not started: nothing connects yet
    monkeypatch.setenv("P2PDIST_LAN", "1")
    with pytest.raises(UsageError, match="both P2PDIST_PEERS and P2PDIST_LAN"):
        Group.from_env()
    monkeypatch.delenv("P2PDIST_PEERS")
    monkeypatch.setenv("P2PDIST_RELAY", "https://127.0.0.1:9/?pin=" + "a" * 52)
    with pytest.raises(UsageError, match="both P2PDIST_RELAY and P2PDIST_LAN"):
        Group.from_env()
    monkeypatch.delenv("P2PDIST_RELAY")
    monkeypatch.setenv("P2PDIST_LISTEN", "127.0.0.1:0")
    lan = Group.from_env()  # found on the local network: no addresses, no relay
    assert lan._addresses is None and lan._relay_url is None and lan._listen == "127.0.0.1:0"
    monkeypatch.setenv("P2PDIST_LAN", "0")
    with pytest.raises(UsageError, match="P2PDIST_LAN=1"):  # nothing says how to reach them
        Group.from_env()
    monkeypatch.setenv("P2PDIST_LAN", "maybe")
    with pytest.raises(UsageError, match="P2PDIST_LAN must be 1 or 0"):
        Group.from_env()


def test_from_env_says_which_variable_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("P2PDIST_RANK", "P2PDIST_WORLD", "P2PDIST_SEED", "P2PDIST_PEERS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=r"P2PDIST_RANK is not set.*p2pdist launch"):
        Group.from_env()
    monkeypatch.setenv("P2PDIST_RANK", "0")
    monkeypatch.setenv("P2PDIST_WORLD", "two")
    with pytest.raises(UsageError, match="must be non-negative decimal integers"):
        Group.from_env()
