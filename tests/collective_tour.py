"""Every collective at once: one batch of mixed calls started together on every rank, each
result checked against numpy. Used over loopback TCP and through a relay process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import numpy as np

from p2pdist import Group

# The compressed bounds of docs/collectives.md (max error / max |float64 sum|), worlds 2-4.
WIRE_BOUNDS = {"float16": 2e-3, "bfloat16": 2e-2, "int8": 3e-2}
BIG = 120_000  # above small_bytes: the ring or pairwise paths, in several chunks


def _inputs(world: int) -> dict[str, list[Any]]:
    rng = np.random.default_rng(world)
    counts = rng.integers(0, 3, size=(world, world))
    counts[0, :] = 0  # rank 0 sends nothing in all_to_all_v
    return {
        "big": [rng.standard_normal(BIG).astype(np.float32) for _ in range(world)],
        "small": [rng.integers(-50, 50, 33).astype(np.int64) for _ in range(world)],
        "rows": [rng.standard_normal((world, 5)) for _ in range(world)],
        "blocks": [rng.standard_normal((world, 4, 3)) for _ in range(world)],
        "v": [
            [np.full((counts[r, p], 2), 10 * r + p, np.float32) for p in range(world)]
            for r in range(world)
        ],
    }


def _calls(g: Group, data: dict[str, list[Any]]) -> list[Awaitable[Any]]:
    """This rank's batch, in the same order on every rank (the order is the match)."""
    r, n = g.rank, g.size
    big, small = data["big"][r], data["small"][r]
    root_blocks = data["blocks"][n - 1]
    return [
        g.all_reduce(big),
        g.all_reduce(big, mode="deterministic"),
        g.all_reduce(big, wire_dtype="float16"),
        g.all_reduce(big, wire_dtype="bfloat16"),
        g.all_reduce(big, wire_dtype="int8", block=128),
        g.all_reduce(small, "max"),
        g.reduce(big, dst=1),
        g.reduce_scatter(big),
        g.all_gather(small),
        g.gather(small, dst=n - 1),
        g.scatter(root_blocks if r == n - 1 else None, src=n - 1, like=root_blocks[0]),
        g.broadcast(big if r == 0 else np.empty_like(big), src=0),
        g.all_to_all(data["rows"][r]),
        g.all_to_all_v(data["v"][r]),
        g.barrier(),
        g.all_reduce(small, "sum", mode="deterministic"),
        g.reduce_scatter(big, "mean", wire_dtype="bfloat16"),
        g.reduce(big, dst=n - 1, wire_dtype="int8"),
    ]


def _check(rank: int, world: int, got: list[Any], data: dict[str, list[Any]]) -> None:
    big, small = data["big"], data["small"]
    exact = np.sum([x.astype(np.float64) for x in big], axis=0)
    in_order = big[0].astype(np.float64)
    for x in big[1:]:
        in_order = in_order + x  # rank order in float64, rounded once below
    scale = float(np.abs(exact).max())
    np.testing.assert_allclose(got[0], exact, rtol=1e-4, atol=1e-4)
    assert got[1].tobytes() == in_order.astype(np.float32).tobytes(), "deterministic bits"
    for out, wire in zip(got[2:5], ("float16", "bfloat16", "int8"), strict=True):
        err = float(np.abs(out - exact).max()) / scale
        assert err <= WIRE_BOUNDS[wire], (wire, err)
    np.testing.assert_array_equal(got[5], np.max(small, axis=0))
    if rank == 1:
        np.testing.assert_allclose(got[6], exact, rtol=1e-4, atol=1e-4)
    else:
        assert got[6] is None
    np.testing.assert_allclose(got[7], np.array_split(exact, world)[rank], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[8], np.stack(small))
    if rank == world - 1:
        np.testing.assert_array_equal(got[9], np.stack(small))
    else:
        assert got[9] is None
    np.testing.assert_array_equal(got[10], data["blocks"][world - 1][rank])
    np.testing.assert_array_equal(got[11], big[0])
    for p in range(world):
        np.testing.assert_array_equal(got[12][p], data["rows"][p][rank])
        np.testing.assert_array_equal(got[13][p], data["v"][p][rank])
    assert got[14] is None
    np.testing.assert_array_equal(got[15], np.sum(small, axis=0))
    piece = np.array_split(exact, world)[rank]
    err = float(np.abs(got[16] * world - piece).max()) / scale
    assert got[16].dtype == np.float32 and err <= WIRE_BOUNDS["bfloat16"], err
    if rank == world - 1:
        err = float(np.abs(got[17] - exact).max()) / scale
        assert err <= WIRE_BOUNDS["int8"], err
    else:
        assert got[17] is None


async def every_collective_at_once(gs: list[Group]) -> None:
    """Start one batch of every collective on every rank together; check all results,
    that ranks agree bit for bit where they must, then split and reduce in sub-groups."""
    world = len(gs)
    data = _inputs(world)

    async def batch(g: Group) -> list[Any]:
        tasks = [asyncio.ensure_future(c) for c in _calls(g, data)]
        return list(await asyncio.gather(*tasks))

    results = await asyncio.gather(*(batch(g) for g in gs))
    for rank, got in enumerate(results):
        _check(rank, world, got, data)
    for i in (0, 1, 2, 3, 4):  # every rank holds the same bits of every all_reduce
        assert len({res[i].tobytes() for res in results}) == 1, f"call {i}: ranks disagree"

    subs = await asyncio.gather(*(g.split(g.rank % 2, key=-g.rank) for g in gs))
    try:
        halves = [s for s in subs if s is not None]
        assert len(halves) == world  # every rank named a colour
        sums = await asyncio.gather(
            *(s.all_reduce(np.array([g.rank])) for g, s in zip(gs, halves, strict=True))
        )
        for g, s, total in zip(gs, halves, sums, strict=True):
            members = [r for r in range(world) if r % 2 == g.rank % 2]
            assert int(total[0]) == sum(members)
            assert s.rank == sorted(members, reverse=True).index(g.rank)  # ordered by key
    finally:
        await asyncio.gather(*(s.close() for s in subs if s is not None))
