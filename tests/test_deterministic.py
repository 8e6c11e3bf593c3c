"""Deterministic reductions: rank-order float64, rounded once, whatever the timing."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import GroupConfig, MismatchError, TransportConfig, UsageError
from p2pdist.group.link import CollectiveLink
from p2pdist.group.ops import reduce_op
from p2pdist.group.ordered import fold_scratch, ordered_reduce


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """Reduce in rank order in float64 (complex128), round once to the input dtype.

    Complex products are ``(ac - bd) + (ad + bc)i`` and a complex mean divides each part,
    every real operation rounded once (numpy's own complex multiply gives other last bits
    for other array lengths, and its complex division can turn inf into NaN)."""
    wide = np.promote_types(xs[0].dtype, np.float64)
    acc = xs[0].astype(wide)
    for x in xs[1:]:
        if op == "prod" and wide.kind == "c":
            y = x.astype(wide)
            product = np.empty_like(acc)
            product.real = acc.real * y.real - acc.imag * y.imag
            product.imag = acc.real * y.imag + acc.imag * y.real
            acc = product
        elif op == "prod":
            acc *= x
        else:
            acc += x
    if op == "mean":
        if wide.kind == "c":
            acc.real /= len(xs)
            acc.imag /= len(xs)
        else:
            acc /= len(xs)
    return acc.astype(xs[0].dtype)


def inputs(world: int, n: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # wildly different magnitudes make float sums order-sensitive
    top = 3 if dtype == "float16" else 7  # float16 overflows past 65504
    scale = 10.0 ** rng.integers(-top + 1, top, size=n)
    xs = [rng.standard_normal(n) * scale for _ in range(world)]
    if dtype.startswith("complex"):
        xs = [x + 1j * rng.standard_normal(n) * scale for x in xs]
    return [x.astype(dtype) for x in xs]


@pytest.fixture
def jitter(monkeypatch: pytest.MonkeyPatch) -> random.Random:
    """Random delays before every collective send and receive (changes arrival order)."""
    rng = random.Random(0)
    send, recv = CollectiveLink.send, CollectiveLink.recv

    async def slow_send(self: CollectiveLink, peer: int, payload: memoryview) -> None:
        await asyncio.sleep(rng.random() * 0.003)
        await send(self, peer, payload)

    async def slow_recv(self: CollectiveLink, peer: int, nbytes: int) -> memoryview:
        await asyncio.sleep(rng.random() * 0.003)
        return await recv(self, peer, nbytes)

    monkeypatch.setattr(CollectiveLink, "send", slow_send)
    monkeypatch.setattr(CollectiveLink, "recv", slow_recv)
    return rng


@pytest.mark.parametrize("world", [2, 3, 5])
async def test_bitwise_equal_to_reference_across_runs_with_random_delays(
    world: int, jitter: random.Random
) -> None:
    async with groups(world) as gs:
        for dtype in ["float16", "float32", "float64", "complex64"]:
            for n in [0, 1, world - 1, 1000, 70_000]:
                for op in ["sum", "mean", "prod"] if dtype != "float16" else ["sum"]:
                    xs = inputs(world, n, dtype, seed=n)
                    if op == "prod":
                        xs = [1 + x / (1 + np.abs(x)) for x in xs]
                    want = reference(xs, op)
                    seen = set()
                    for run in range(3):
                        jitter.seed(run)
                        outs = await asyncio.gather(
                            *(g.all_reduce(xs[g.rank], op, mode="deterministic") for g in gs)
                        )
                        for o in outs:
                            assert o.dtype == want.dtype and o.shape == want.shape
                            seen.add(o.tobytes())
                    assert seen == {want.tobytes()}, (dtype, n, op)


async def test_reduce_scatter_deterministic_and_chunk_independent() -> None:
    xs = inputs(3, 300_000, "float32", seed=7)
    want = reference(xs, "sum")
    results = []
    for chunk in [4096, 1 << 20]:
        async with groups(3, config={"chunk_bytes": chunk}) as gs:
            outs = await asyncio.gather(
                *(g.reduce_scatter(xs[g.rank], mode="deterministic") for g in gs)
            )
            for r, piece in enumerate(outs):
                assert piece.tobytes() == np.array_split(want, 3)[r].tobytes()
            results.append(b"".join(o.tobytes() for o in outs))
    assert results[0] == results[1]


async def test_fast_mode_differs_from_rank_order_somewhere() -> None:
    """Guard: the deterministic test is meaningful only if plain float32 order matters."""
    xs = inputs(3, 70_000, "float32", seed=3)
    async with groups(3) as gs:
        fast = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
    assert fast[0].tobytes() != reference(xs, "sum").tobytes()


async def test_a_deterministic_group_default_gives_the_reference_without_a_mode() -> None:
    xs = inputs(3, 70_000, "float32", seed=3)  # where the fast mode differs (the guard above)
    async with groups(3, config={"mode": "deterministic"}) as gs:
        outs = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
        pieces = await asyncio.gather(*(g.reduce_scatter(xs[g.rank]) for g in gs))
    want = reference(xs, "sum")
    assert all(o.tobytes() == want.tobytes() for o in outs)
    assert b"".join(p.tobytes() for p in pieces) == want.tobytes()


async def test_group_default_mode_and_disagreement() -> None:
    async with groups(2) as gs:
        x = np.linspace(0, 1, 10, dtype=np.float32)
        results = await asyncio.gather(
            gs[0].all_reduce(x, mode="deterministic", timeout=5),
            gs[1].all_reduce(x, mode="fast", timeout=5),
            return_exceptions=True,
        )
        text = " ".join(map(str, results))
        assert any(isinstance(r, MismatchError) for r in results), text
        assert "deterministic" in text
        with pytest.raises(UsageError, match="mode"):
            await gs[0].all_reduce(x, mode="exact")
    # where both modes would run the same path, a disagreement is still caught
    for call in (
        lambda g, m: g.all_reduce(np.arange(5), mode=m, timeout=5),
        lambda g, m: g.all_reduce(np.ones(5), "max", mode=m, timeout=5),
        lambda g, m: g.reduce_scatter(np.arange(6), mode=m, timeout=5),
        lambda g, m: g.reduce(np.arange(5), 0, mode=m, timeout=5),
    ):
        async with groups(2) as gs:
            results = await asyncio.gather(
                call(gs[0], "deterministic"), call(gs[1], None), return_exceptions=True
            )
            text = " ".join(map(str, results))
            assert any(isinstance(r, MismatchError) for r in results), text
    with pytest.raises(ValueError, match="mode"):
        GroupConfig(mode="exact", transport=TransportConfig())


async def test_integer_and_max_are_exact_in_either_mode() -> None:
    async with groups(3) as gs:
        xs = [np.arange(1000, dtype=np.int32) * (r + 1) for r in range(3)]
        outs = await asyncio.gather(*(g.all_reduce(xs[g.rank], mode="deterministic") for g in gs))
        np.testing.assert_array_equal(outs[0], xs[0] * 6)
        fl = inputs(3, 5000, "float32", seed=1)
        mx = await asyncio.gather(
            *(g.all_reduce(fl[g.rank], "max", mode="deterministic") for g in gs)
        )
        np.testing.assert_array_equal(mx[2], np.maximum.reduce(fl))


@pytest.mark.parametrize(
    "config",
    [{}, {"small_bytes": 0, "algorithm": "ring"}, {"small_bytes": 0, "algorithm": "pairwise"}],
)
async def test_max_and_min_of_signed_zeros_do_not_depend_on_the_algorithm(
    config: dict[str, object],
) -> None:
    """Float max and min are exact, but np.maximum(-0.0, 0.0) and np.maximum(0.0, -0.0)
    differ: on the fast path the sign of a zero result followed the algorithm (and the
    segment), -0 one way and +0 another (an audit). The deterministic mode folds them in
    rank order too, so every algorithm gives the reference's bits."""
    signs = [-0.0, 0.0, -0.0]
    xs = [np.full(7, signs[r], np.float32) for r in range(3)]
    xs[1][3] = np.nan
    async with groups(3, config=config) as gs:
        for op, ufunc in (("max", np.maximum), ("min", np.minimum)):
            outs = await asyncio.gather(
                *(g.all_reduce(xs[g.rank], op, mode="deterministic") for g in gs)
            )
            want = ufunc(ufunc(xs[0], xs[1]), xs[2])
            assert all(o.tobytes() == want.tobytes() for o in outs), (op, outs, want)


def with_one_nan(a: np.ndarray) -> np.ndarray:
    """``a`` with every NaN (each part of a complex) numpy's own ``np.nan``."""
    a = a.copy()
    parts = a.view(a.real.dtype) if a.dtype.kind == "c" else a
    parts[np.isnan(parts)] = np.nan
    return a


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("dtype", "op"), [("float32", "sum"), ("float64", "sum"), ("complex64", "prod")]
)
async def test_a_nan_result_has_the_same_bits_whatever_the_path_and_chunk(
    world: int, dtype: str, op: str
) -> None:
    """Which operand's NaN a numpy loop passes on (its sign) depends on where an element
    falls in the loop's vectors, so a NaN result's sign changed with the chunk size and
    the path (an acceptance check; ranks still agreed). Every NaN is np.nan now, and the
    rest is the reference's."""
    n = 4003
    xs = inputs(world, n, dtype, seed=11)
    for r, x in enumerate(xs):
        x.real[::5] = np.nan if r % 2 == 0 else -np.nan  # +NaN and -NaN meet
        x.real[r + 1 :: 11] = np.nan  # and NaN meets numbers
        x.real[3::50] = np.inf if r % 2 == 0 else -np.inf  # inf - inf is x86's -NaN
    with np.errstate(invalid="ignore", over="ignore"):
        want = with_one_nan(reference(xs, op))
    assert np.isnan(want.real).any() and np.isfinite(want.real).any()
    configs = [
        {"small_bytes": 1 << 24},  # every rank folds everything in one round
        {"small_bytes": 0, "chunk_bytes": 4096},
        {"small_bytes": 0, "chunk_bytes": 4104},  # chunks off numpy's vector widths
        {"small_bytes": 0},
    ]
    for config in configs:
        async with groups(world, config=config) as gs:
            outs = await asyncio.gather(
                *(g.all_reduce(xs[g.rank], op, mode="deterministic") for g in gs)
            )
        for out in outs:
            assert out.tobytes() == want.tobytes(), config


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("op", ["sum", "mean", "prod"])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_ordered_reduce_blocks_equal_the_reference(dtype: str, op: str, parts: int) -> None:
    # 70_000 elements: several float64 blocks plus a partial one, with the scratch made
    # by ordered_reduce itself and with a smaller scratch passed in.
    xs = inputs(parts, 70_000, dtype, seed=parts)
    rop = reduce_op(op, np.dtype(dtype))
    with np.errstate(all="ignore"):  # float16 products overflow to inf: same bits
        want = reference(xs, op)
        for scratch in (None, fold_scratch(np.dtype(dtype), 5000)):
            out = np.empty_like(xs[0])
            ordered_reduce(xs, rop, parts, out, scratch)
            np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("n", [5, 40_000])  # the one-round and the ring sizes
async def test_reduce_takes_the_deterministic_mode_too(n: int) -> None:
    """``reduce`` honours ``mode`` (and the group's default): dst gets the bits the
    deterministic all_reduce gives, the float64 rank-order reference rounded once (it
    used to fold in float32 in arrival order: 0.0 for 1 + 1e8 - 1e8 on one path, 1.0 on
    the other); in place on dst too."""
    world = 3
    xs = [np.full(n, v, np.float32) for v in (1.0, 1e8, -1e8)]
    want = reference(xs, "sum")
    assert want[0] == 1.0
    async with groups(world, config={"mode": "deterministic"}) as gs:
        got = await asyncio.gather(*(g.reduce(xs[g.rank].copy(), 1) for g in gs))
        assert got[0] is None and got[2] is None
        np.testing.assert_array_equal(got[1], want)
        mine = [x.copy() for x in xs]
        await asyncio.gather(*(g.reduce(mine[g.rank], 0, "mean", out=mine[g.rank]) for g in gs))
        np.testing.assert_array_equal(mine[0], reference(xs, "mean"))
        fast = await asyncio.gather(*(g.reduce(xs[g.rank], 2, mode="fast") for g in gs))
        assert fast[2] is not None  # the fast mode is still there, per call
        assert fast[0] is None and fast[2].dtype == np.float32 and fast[2].shape == (n,)


async def test_complex_products_and_means_do_not_depend_on_length_or_spread_inf() -> None:
    """Deterministic complex prod gives the same bits with 4 KiB chunks as with 1 MiB
    ones and as the one-round path (numpy's complex multiply gave other last bits for a
    one-element tail chunk), and a complex mean divides each part: (1+inf j, 1) -> 1+inf j
    in both modes (it was nan+inf j)."""
    xs = inputs(2, 514, "complex128", seed=3)
    want = reference(xs, "prod")
    results = []
    for chunk in (4096, 1 << 20):
        async with groups(2, config={"chunk_bytes": chunk, "small_bytes": 4096}) as gs:
            got = await asyncio.gather(
                *(g.all_reduce(xs[g.rank], "prod", mode="deterministic") for g in gs)
            )
            results.append(got[0])
            small = await asyncio.gather(
                *(g.all_reduce(xs[g.rank][:100], "prod", mode="deterministic") for g in gs)
            )
            np.testing.assert_array_equal(small[1].view(np.uint8), want[:100].view(np.uint8))
            ys = [np.array([complex(1, np.inf)]), np.array([1 + 0j])]
            for mode in ("fast", "deterministic"):
                mean = await asyncio.gather(
                    *(g.all_reduce(ys[g.rank], "mean", mode=mode) for g in gs)
                )
                assert mean[0][0] == complex(1, np.inf), (mode, mean[0])
    for got in results:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
