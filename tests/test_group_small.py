"""The one-round direct all_reduce of small arrays: in place, into out=, every op."""

from __future__ import annotations

import asyncio
from functools import reduce

import numpy as np
import pytest
from group_helpers import groups


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "mean"])
async def test_small_all_reduce_in_place_and_into_out_matches_rank_order(
    world: int, op: str
) -> None:
    rng = np.random.default_rng(world)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(world)]
    originals = [x.copy() for x in xs]
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "mean": np.add}[op]
    want = reduce(lambda a, b: ufunc(a, b), xs)  # left to right, in rank order
    if op == "mean":
        want = want / np.float32(world)
    async with groups(world) as gs:
        bufs = [x.copy() for x in xs]
        res = await asyncio.gather(*(g.all_reduce(bufs[g.rank], op, out=bufs[g.rank]) for g in gs))
        outs = [np.empty_like(x) for x in xs]
        res2 = await asyncio.gather(*(g.all_reduce(xs[g.rank], op, out=outs[g.rank]) for g in gs))
        fresh = await asyncio.gather(*(g.all_reduce(xs[g.rank], op) for g in gs))
    for r in range(world):
        assert res[r] is bufs[r] and res2[r] is outs[r]
        for got in (bufs[r], outs[r], fresh[r]):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(xs[r], originals[r])  # the input is left alone
