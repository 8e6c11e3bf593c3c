"""Byte order and refused dtypes in recv, collectives' ``out=`` and GradientBuckets.add."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import GradientBuckets, GroupBrokenError, UsageError
from p2pdist.group import p2p


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": ">f4"},
        {"dtype": "=f4"},
        {"like": np.empty(3, ">f4")},
        {"like": np.empty(3, ">f4"), "dtype": "<f4"},
    ],
    ids=["dtype>f4", "dtype=f4", "like>f4", "like>f4+dtype<f4"],
)
async def test_recv_big_endian_expectation_matches_a_float32_message(kw: dict[str, Any]) -> None:
    async with groups(2, timeout=5.0) as (a, b):
        await a.send(np.arange(3, dtype=np.float32), 1)
        got = await b.recv(0, **kw)
        assert got.dtype == np.float32 and got.tolist() == [0.0, 1.0, 2.0]
        await a.send(np.arange(4, 7, dtype=np.float32), 1)  # the link stays in step
        assert (await b.recv(0)).tolist() == [4.0, 5.0, 6.0]


@pytest.mark.parametrize("chunk", [p2p.CHUNK, 8])
async def test_recv_into_big_endian_out_fills_the_right_values(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p2p, "CHUNK", chunk)  # 8: the message travels in several frames
    async with groups(2, timeout=5.0) as (a, b):
        sent = np.linspace(-2.5, 7.25, 12, dtype=np.float64).reshape(3, 4)
        await a.send(sent.astype(">f8"), 1)  # the sender converts big-endian arrays
        out = np.zeros((3, 4), ">f8")
        got = await b.recv(0, out=out)
        assert got is out and out.dtype == np.dtype(">f8")
        np.testing.assert_array_equal(out, sent)


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": object},
        {"dtype": "U4"},
        {"dtype": "M8[s]"},
        {"dtype": [("a", "<f4")]},
        {"out": np.empty(3, object)},
        {"out": np.empty(3, "U4")},
        {"like": np.empty(3, object)},
        {"out": np.empty(3, object), "dtype": np.float32},
    ],
    ids=[
        "object",
        "U4",
        "datetime",
        "structured",
        "out-object",
        "out-U4",
        "like-object",
        "out-object+f4",
    ],
)
async def test_recv_with_a_dtype_that_cannot_travel_is_refused_without_taking_the_message(
    kw: dict[str, Any],
) -> None:
    async with groups(2, timeout=5.0) as (a, b):
        await a.send(np.arange(3, dtype=np.float32), 1)
        with pytest.raises(UsageError, match="cannot travel"):
            await b.recv(0, **kw)
        got = await b.recv(0, dtype=np.float32)  # the message is still there
        assert got.tolist() == [0.0, 1.0, 2.0]


async def test_send_of_more_dimensions_than_travel_is_refused_before_it_takes_its_place() -> None:
    """33 dimensions (the wire carries 32): refused at the sender, as a UsageError, with
    nothing sent and no place in the order taken; it used to go out, break the link at
    the receiver and the group with it."""
    async with groups(2, timeout=5.0) as (a, b):
        with pytest.raises(UsageError, match="33 dimensions"):
            await a.send(np.ones((1,) * 33, np.float32), 1)
        # A recv that expects what no sender can send waited its timeout, blaming the
        # peer (a user trial): refused at once now, taking no message.
        big: list[dict[str, Any]] = [
            {"like": np.ones((1,) * 33, np.float32)},
            {"shape": (1,) * 33, "dtype": np.float32},
            {"out": np.ones((1,) * 33, np.float32)},
            {"shape": (0, 5, 2**60), "dtype": np.uint8},
        ]
        for kw in big:
            with pytest.raises(UsageError, match="recv expects what cannot travel"):
                await b.recv(0, timeout=30, **kw)
        await a.send(np.ones((1,) * 32, np.float32), 1)
        await a.send(np.arange(3, dtype=np.float32), 1)
        assert (await b.recv(0)).shape == (1,) * 32
        assert (await b.recv(0)).tolist() == [0.0, 1.0, 2.0]
        sums = await asyncio.gather(a.all_reduce(np.ones(2)), b.all_reduce(np.ones(2)))
        assert [s.tolist() for s in sums] == [[2.0, 2.0]] * 2  # the group is whole


async def test_an_empty_array_the_receiver_cannot_make_is_refused_at_the_sender() -> None:
    """An empty array with a huge extent (numpy makes (0, 5, 2**60) of uint8: 0 bytes)
    went out, the receiver's header check refused it as too large, and that broke the
    group (an audit). The sender now refuses it as the receiver would, as a UsageError;
    all_gather's result of it, which numpy cannot make, is a UsageError too."""
    huge_empty = np.empty((0, 5, 2**60), np.uint8)
    async with groups(2, timeout=5.0) as (a, b):
        with pytest.raises(UsageError, match="too large"):
            await a.send(huge_empty, 1)
        for g in (a, b):
            with pytest.raises(UsageError, match="the result"):
                await g.all_gather(huge_empty)
        await a.send(np.empty((0, 5, 7), np.uint8), 1)
        assert (await b.recv(0)).shape == (0, 5, 7)
        sums = await asyncio.gather(a.all_reduce(np.ones(2)), b.all_reduce(np.ones(2)))
        assert [s.tolist() for s in sums] == [[2.0, 2.0]] * 2  # the group is whole


async def test_like_that_disagrees_with_out_or_xs_is_a_usage_error() -> None:
    """recv(out=, like=) and a non-source scatter(like=, out=) or (xs, like=) ignored
    a like= that disagreed (while shape=/dtype= against out= were checked): an audit.
    Now like= says what is expected, and out= (or xs) must match it."""
    async with groups(2, timeout=5.0) as (a, b):
        await a.send(np.arange(3), 1)
        with pytest.raises(UsageError, match=r"out has int64\[3\] but dtype float32"):
            await b.recv(0, out=np.zeros(3, np.int64), like=np.zeros((5, 5), np.float32))
        got = await b.recv(0, out=np.zeros(3, np.int64), like=np.zeros(3, ">i8"))
        assert got.tolist() == [0, 1, 2]  # the message waited; a like that agrees is fine
        with pytest.raises(UsageError, match="out has float64"):
            await b.scatter(None, 0, like=np.zeros(7, np.int8), out=np.zeros(2))
        with pytest.raises(UsageError, match="like is int8"):
            await b.scatter(np.zeros((2, 2)), 0, like=np.zeros(7, np.int8))
        rows = np.arange(4.0).reshape(2, 2)
        with pytest.raises(UsageError, match="like is int8"):  # on the source too
            await a.scatter(rows, 0, like=np.zeros(7, np.int8))
        got_a, got_b = await asyncio.gather(
            a.scatter(rows, 0, like=np.zeros(2, ">f8")),  # one that agrees is fine
            b.scatter(None, 0, like=np.zeros(2), out=np.zeros(2)),
        )
        assert got_a.tolist() == [0.0, 1.0] and got_b.tolist() == [2.0, 3.0]


async def test_collective_into_big_endian_out_is_a_clear_usage_error() -> None:
    async with groups(2, timeout=5.0) as gs:
        xs = [(np.arange(4) + g.rank).astype(">f4") for g in gs]
        for g, x in zip(gs, xs, strict=True):
            with pytest.raises(UsageError, match="big-endian"):
                await g.all_reduce(x, out=x)
        # Nothing travelled: the group is in step, and a big-endian input works.
        outs = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(gs, xs, strict=True)))
        for o in outs:
            assert o.dtype == np.float32 and o.tolist() == [1.0, 3.0, 5.0, 7.0]


@pytest.mark.parametrize(
    "op, reduce, bad",
    [
        ("mean", {}, np.int32),
        ("max", {}, np.complex64),
        ("sum", {"wire_dtype": "float16"}, np.int32),
        ("sum", {}, np.dtype("U4")),
    ],
    ids=["mean-int32", "max-complex", "wire-int32", "str"],
)
async def test_bucket_add_refuses_what_the_all_reduce_would_refuse_and_reduces_the_rest(
    op: str, reduce: dict[str, Any], bad: Any
) -> None:
    async with groups(2, timeout=5.0) as gs:
        bs = await asyncio.gather(
            *(GradientBuckets.create(g, bucket_bytes=16, op=op, **reduce) for g in gs)
        )
        arrays = []
        for b, g in zip(bs, gs, strict=True):
            v = g.rank + 1.0
            good = [
                np.full(3, v, np.float32),
                np.full(2, v, np.float64),
                np.full(5, v, ">f4"),  # reduced as float32, written back big-endian
                np.full(6, v, np.float32),
            ]
            refused = np.zeros(4, bad)
            b.add(good[0])
            with pytest.raises(UsageError):
                b.add(refused)  # at once, not from wait()
            for x in good[1:]:
                b.add(x)
            arrays.append((good, refused))
        await asyncio.gather(*(b.wait() for b in bs))
        want = {"mean": 1.5, "max": 2.0, "sum": 3.0}[op]
        for good, refused in arrays:
            for x in good:
                np.testing.assert_array_equal(x, np.full(x.shape, want, x.dtype))
            assert np.array_equal(refused, np.zeros(4, bad))  # untouched


async def test_a_failed_bucket_names_the_buckets_left_unreduced() -> None:
    async with groups(2, timeout=3.0) as gs:
        bs = await asyncio.gather(*(GradientBuckets.create(g, bucket_bytes=16) for g in gs))
        await gs[1].close()  # rank 0's buckets now fail: its peer is gone
        xs = [np.ones(4, np.float32) for _ in range(3)]  # one bucket each
        for x in xs:
            bs[0].add(x)
        with pytest.raises(GroupBrokenError, match="rank 1") as info:  # it left
            await bs[0].wait()
        notes = getattr(info.value, "__notes__", [])
        assert any("bucket 0 of 3" in n and "3 arrays" in n for n in notes), notes
        for x in xs:
            assert x.tolist() == [1.0] * 4
