"""Arguments users get wrong: numpy integers as ranks, bools as numbers, scatter inputs
that are not rows, and int8's block size on the other wires (from a misuse review)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import Group, GroupConfig, TransportConfig, UsageError


async def test_numpy_integers_are_ranks_colors_and_keys() -> None:
    """Ranks often come from numpy (np.argmax, np.arange): np.int64(1) was refused as
    "not a rank in [0, 2)", and the peer waited out its timeout."""
    async with groups(2, timeout=10) as gs:
        x = np.arange(3.0)
        got = await asyncio.gather(gs[0].send(x, np.int64(1)), gs[1].recv(np.int32(0), like=x))
        np.testing.assert_array_equal(got[1], x)
        out = await asyncio.gather(*(g.broadcast(x + g.rank, src=np.int64(1)) for g in gs))
        np.testing.assert_array_equal(out[0], x + 1)
        subs = await asyncio.gather(*(g.split(np.int64(0), key=np.int32(-g.rank)) for g in gs))
        assert [s.rank for s in subs if s is not None] == [1, 0]
        await asyncio.gather(*(g.all_reduce(np.ones(2), timeout=np.float32(5)) for g in gs))
        with pytest.raises(UsageError, match="64-bit"):  # it raised numpy's OverflowError
            await gs[0].split(0, key=np.uint64(1 << 63))
    assert Group.from_seed("a-seed-of-enough-bytes", rank=np.int64(1), world=np.int64(2),
                           peers=["127.0.0.1:1", "127.0.0.1:2"]).rank == 1  # fmt: skip


@pytest.mark.parametrize(
    "call",
    [
        lambda g: g.send(np.ones(2), True),
        lambda g: g.broadcast(np.ones(2), src=np.bool_(False)),
        lambda g: g.split(True),
        lambda g: g.all_reduce(np.ones(2), timeout=True),
    ],
)
async def test_bools_are_not_numbers(call: object) -> None:
    async with groups(2, timeout=10) as gs:
        with pytest.raises(UsageError):
            await call(gs[0])  # type: ignore[operator]
    for flag in (True, np.True_):
        with pytest.raises(ValueError, match="timeout"):
            GroupConfig(timeout=flag)


@pytest.mark.parametrize(
    ("rank", "xs", "message"),
    [
        (1, [], "2 rows"),  # a non-source rank's xs is checked too (it raised IndexError)
        (1, np.ones((5, 2)), "2 rows"),  # it was accepted silently
        (0, [[1.0], [1.0, 2.0]], "one array of rows"),  # ragged: numpy's ValueError
    ],
)
async def test_scatter_inputs_that_are_not_rows_are_usage_errors(
    rank: int, xs: object, message: str
) -> None:
    async with groups(2, timeout=10) as gs:
        with pytest.raises(UsageError, match=message):
            await gs[rank].scatter(xs, src=0)  # type: ignore[arg-type]


async def test_block_sizes_matter_to_int8_only() -> None:
    """block= is int8's: a float16 call whose ranks passed different blocks (unused)
    was a MismatchError that broke the group."""
    async with groups(2, timeout=10) as gs:
        xs = [np.full(8, float(r + 1), np.float32) for r in range(2)]
        got = await asyncio.gather(
            *(
                g.all_reduce(x, wire_dtype="float16", block=64 * (g.rank + 1))
                for g, x in zip(gs, xs, strict=True)
            )
        )
        np.testing.assert_array_equal(got[0], np.full(8, 3.0, np.float32))


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: GroupConfig(chunk_bytes=4096.5), "chunk_bytes"),  # broke the first ring call
        (lambda: GroupConfig(max_message_bytes=-5), "max_message_bytes"),
        (lambda: GroupConfig(small_bytes=-1), "small_bytes"),
        (lambda: GroupConfig(timeout="5"), "timeout"),  # a bare TypeError
        (lambda: GroupConfig(timeout=0), "timeout"),
        (lambda: TransportConfig(keepalive_interval=float("nan")), "keepalive_interval"),
        (lambda: TransportConfig(max_buffered=0), "max_buffered"),
        (lambda: TransportConfig(write_buffer_high=-1), "write_buffer_high"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_them(make: Any, name: str) -> None:
    with pytest.raises(UsageError, match=name):
        make()


async def test_numpy_numbers_make_good_settings() -> None:
    """Taken, and kept as plain numbers: formation compares settings through msgpack,
    which refused numpy's (start() failed with "can not serialize 'numpy.int64'")."""
    cfg = GroupConfig(timeout=np.float32(5), chunk_bytes=np.int64(1 << 16))
    assert type(cfg.chunk_bytes) is int and type(cfg.timeout) is float
    transport = TransportConfig(max_buffered=np.int64(1 << 20), idle_timeout=np.float64(30))
    assert type(transport.max_buffered) is int and type(transport.idle_timeout) is float
    extra = {"chunk_bytes": np.int64(1 << 16), "small_bytes": np.int32(0)}
    async with groups(2, timeout=10, config=extra, max_buffered=np.int64(1 << 24)) as gs:
        outs = await asyncio.gather(*(g.all_reduce(np.ones(1 << 16)) for g in gs))
        np.testing.assert_array_equal(outs[0], np.full(1 << 16, 2.0))


async def test_broadcast_without_x_on_a_receiving_rank_says_what_it_needs() -> None:
    """broadcast(None, src=0) on the other ranks (as scatter's xs may be None there) was
    refused as "dtype object cannot travel on the wire"."""
    async with groups(2, timeout=10) as gs:
        with pytest.raises(UsageError, match="an array like rank 0's"):
            await gs[1].broadcast(None, src=0)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="the array to send"):
            await gs[0].broadcast(None, src=0)  # type: ignore[arg-type]
        x = np.arange(3.0)
        got = await asyncio.gather(gs[0].broadcast(x, 0), gs[1].broadcast(np.empty(3), 0))
        np.testing.assert_array_equal(got[1], x)  # nothing was taken by the refusals


async def test_out_as_another_view_of_the_input_is_in_place() -> None:
    """out=x[:] or out=b.reshape(...) (the input's own memory under another array
    object) was refused as "out overlaps the input without being the same array", though
    out=x is in place."""
    async with groups(2, timeout=10) as gs:
        xs = [np.arange(6.0) + g.rank for g in gs]
        await asyncio.gather(*(g.all_reduce(x, out=x[:]) for g, x in zip(gs, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, 2 * np.arange(6.0) + 1)
        bs = [np.arange(6.0) + 10 * g.rank for g in gs]
        got = await asyncio.gather(
            *(
                g.all_to_all(b.reshape(2, 3), out=b.reshape(2, 3))
                for g, b in zip(gs, bs, strict=True)
            )
        )
        np.testing.assert_array_equal(bs[0], [0, 1, 2, 10, 11, 12])
        np.testing.assert_array_equal(got[1].reshape(-1), [3, 4, 5, 13, 14, 15])
        x = np.arange(4.0)
        with pytest.raises(UsageError, match="overlaps"):  # a shifted view is no such thing
            await gs[0].all_reduce(x[:3], out=x[1:])


async def test_all_to_all_v_takes_any_iterable_of_pieces() -> None:
    """A generator of pieces raised TypeError (len() of it); a TypeError is no usage
    error, so the call was not given back and the other rank got a MismatchError."""
    async with groups(2, timeout=10) as gs:

        def pieces(rank: int) -> Iterator[np.ndarray]:
            return (np.full(p + 1, rank) for p in range(2))

        got = await asyncio.gather(*(g.all_to_all_v(pieces(g.rank)) for g in gs))
        assert [list(a) for a in got[1]] == [[0, 0], [1, 1]]
        with pytest.raises(UsageError, match="a sequence of 2 arrays, got int"):
            await gs[0].all_to_all_v(3)  # type: ignore[arg-type]
