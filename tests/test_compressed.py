"""Compressed all-reduce: error bounds, identical bits, no saturation, error feedback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from group_helpers import groups

from p2pdist import ErrorFeedback, Group, MismatchError, UsageError

# Documented bounds (docs/collectives.md): max |result - float64 sum| / max |float64 sum|
# on Gaussian inputs, for worlds up to 4.
BOUNDS = {"float16": 2e-3, "bfloat16": 2e-2, "int8": 3e-2}


def gaussian(world: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


def rel_error(got: np.ndarray, xs: list[np.ndarray]) -> float:
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


async def reduce_all(gs: list[Group], xs: list[np.ndarray], **kw: object) -> list[np.ndarray]:
    return list(await asyncio.gather(*(g.all_reduce(xs[g.rank], **kw) for g in gs)))  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
async def test_error_within_documented_bound_and_identical(world: int, wire: str) -> None:
    async with groups(world) as gs:
        for n in [5, 1000, 300_001]:  # direct path and ring path
            xs = gaussian(world, n, seed=n)
            outs = await reduce_all(gs, xs, wire_dtype=wire)
            assert outs[0].dtype == np.float32
            assert len({o.tobytes() for o in outs}) == 1, "ranks disagree"
            assert rel_error(outs[0], xs) <= BOUNDS[wire], (wire, n, rel_error(outs[0], xs))
            # mean divides before encoding: the same bound, relative to the float64 mean
            means = await reduce_all(gs, xs, op="mean", wire_dtype=wire)
            assert len({m.tobytes() for m in means}) == 1, "ranks disagree"
            err = rel_error(means[0] * world, xs)
            assert err <= BOUNDS[wire], (wire, n, "mean", err)


# The errors docs/collectives.md measured (1 Mi Gaussian elements, seed 0): all_reduce's
# and reduce_scatter's pieces'. The same data gives the same figures every run, so a
# change that loses accuracy (a hop that adds in the wire dtype, an own piece encoded
# once more) shows here, long before it reaches the bounds above.
MEASURED = {
    2: {"float16": (4.8e-4, 2.6e-4), "bfloat16": (3.7e-3, 2.2e-3), "int8": (5.8e-3, 2.9e-3)},
    4: {"float16": (8.9e-4, 5.8e-4), "bfloat16": (5.4e-3, 3.8e-3), "int8": (8.9e-3, 7.4e-3)},
}


@pytest.mark.parametrize("world", [2, 4])
async def test_error_is_what_the_docs_measured(world: int) -> None:
    xs = gaussian(world, 1 << 20, seed=0)
    async with groups(world) as gs:
        for wire, (whole, pieces) in MEASURED[world].items():
            outs = await reduce_all(gs, xs, wire_dtype=wire)
            assert rel_error(outs[0], xs) <= 1.1 * whole, (wire, rel_error(outs[0], xs))
            own = await asyncio.gather(*(g.reduce_scatter(xs[g.rank], wire_dtype=wire) for g in gs))
            err = rel_error(np.concatenate(own), xs)
            assert err <= 1.1 * pieces, (wire, err)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_ring_with_many_uneven_chunks(world: int) -> None:
    # chunk_bytes 4096: the ring sends about 4096 wire bytes per message, i.e. 2048
    # elements of a 16-bit wire and 4080 of int8 with 256-element blocks. The first
    # segments have one element more than the last and straddle a chunk boundary, so
    # neighbours hold different numbers of chunks.
    rng = np.random.default_rng(world)
    async with groups(world, config={"chunk_bytes": 4096, "small_bytes": 4096}) as gs:
        for seg in (2 * 2048, 4080):
            n = world * seg + world - 1
            small = [rng.integers(-8, 9, n).astype(np.float32) for _ in range(world)]
            for wire in ("float16", "bfloat16"):  # small integer sums are exact on these
                outs = await reduce_all(gs, small, wire_dtype=wire)
                for out in outs:
                    np.testing.assert_array_equal(out, np.sum(small, axis=0))
            xs = gaussian(world, n, seed=world)
            for wire in ("float16", "bfloat16", "int8"):
                outs = await reduce_all(gs, xs, wire_dtype=wire)
                assert len({o.tobytes() for o in outs}) == 1, "ranks disagree"
                assert rel_error(outs[0], xs) <= BOUNDS[wire], (wire, rel_error(outs[0], xs))


async def test_int8_partial_sums_never_saturate() -> None:
    async with groups(4) as gs:
        xs = [np.full(200_000, 100.0, np.float32) for _ in range(4)]
        outs = await reduce_all(gs, xs, wire_dtype="int8", block=64)
        np.testing.assert_allclose(outs[0], 400.0, rtol=1e-2)  # clipping would give 100


async def test_wire_bytes_shrink_as_documented() -> None:
    async with groups(2) as gs:
        x = gaussian(2, 1 << 20)

        async def sent_for(**kw: object) -> int:
            before = gs[0].connection(1).stats.bytes_sent
            await reduce_all(gs, x, **kw)
            return gs[0].connection(1).stats.bytes_sent - before

        plain = await sent_for()
        for wire, per_elem in [("float16", 2.0), ("bfloat16", 2.0), ("int8", 1 + 4 / 256)]:
            ratio = await sent_for(wire_dtype=wire) / plain
            assert abs(ratio - per_elem / 4) < 0.01, (wire, ratio)


async def long_run_errors(
    step: Callable[[], Awaitable[tuple[np.ndarray, np.ndarray]]],
    truth: np.ndarray,
    steps: int = 30,
) -> tuple[float, float]:
    """Run ``step`` (one call with error feedback, one without: their results)
    ``steps`` times; the largest error of each summed series against ``steps * truth``."""
    with_ef = np.zeros_like(truth)
    without = np.zeros_like(truth)
    for _ in range(steps):
        a, b = await step()
        with_ef += a
        without += b
    return (
        float(np.abs(with_ef - steps * truth).max()),
        float(np.abs(without - steps * truth).max()),
    )


@pytest.mark.parametrize(
    ("world", "n", "op"),
    [
        (2, 4096, "sum"),  # the direct path
        (2, 131_200, "sum"),  # the ring: segments start off the 512-element blocks
        (3, 50_003, "mean"),  # the ring with a hop that re-encodes a partial sum
        (4, 70_001, "sum"),
    ],
)
async def test_error_feedback_keeps_the_long_run_sum_unbiased(world: int, n: int, op: str) -> None:
    """Over 30 calls the summed results track the true sum: every encoding error (the
    input's, a hop's re-encoded partial sum, the owner's final sum) goes into some rank's
    residual, on the direct path and on the ring alike."""
    async with groups(world, config={"small_bytes": 16 << 10}) as gs:
        xs = gaussian(world, n, seed=5)
        truth = np.sum([x.astype(np.float64) for x in xs], axis=0) / (world if op == "mean" else 1)
        efs = [ErrorFeedback() for _ in gs]

        async def step() -> tuple[np.ndarray, np.ndarray]:
            a = await asyncio.gather(
                *(
                    g.all_reduce(
                        xs[g.rank], op, wire_dtype="int8", block=512, error_feedback=efs[g.rank]
                    )
                    for g in gs
                )
            )
            b = await reduce_all(gs, xs, op=op, wire_dtype="int8", block=512)
            assert len({r.tobytes() for r in a}) == 1, "ranks disagree"
            return a[0], b[0]

        err_ef, err_plain = await long_run_errors(step, truth)
        assert err_ef < 0.2 * err_plain, (err_ef, err_plain)


@pytest.mark.parametrize(
    ("world", "n", "op", "wire"),
    [
        (2, 131_200, "sum", "int8"),  # pieces start off the 512-element blocks
        (3, 50_003, "mean", "int8"),  # a hop that re-encodes a partial sum
        (4, 70_001, "sum", "bfloat16"),
    ],
)
async def test_reduce_scatter_error_feedback_keeps_the_long_run_sum_unbiased(
    world: int, n: int, op: str, wire: str
) -> None:
    """reduce_scatter with error feedback (gradients sharded across ranks, as ZeRO does):
    over 30 calls the pieces, joined, track the true sum; every encoding a rank makes
    (its input's pieces, the partial sums it forwards) goes into its residual, and its
    own piece, never encoded, leaves none."""
    async with groups(world) as gs:
        xs = gaussian(world, n, seed=11)
        truth = np.sum([x.astype(np.float64) for x in xs], axis=0) / (world if op == "mean" else 1)
        efs = [ErrorFeedback() for _ in gs]
        kw: dict[str, Any] = {"wire_dtype": wire, "block": 512}

        async def step() -> tuple[np.ndarray, np.ndarray]:
            a = await asyncio.gather(
                *(g.reduce_scatter(xs[g.rank], op, error_feedback=efs[g.rank], **kw) for g in gs)
            )
            b = await asyncio.gather(*(g.reduce_scatter(xs[g.rank], op, **kw) for g in gs))
            return np.concatenate(a), np.concatenate(b)

        err_ef, err_plain = await long_run_errors(step, truth)
        assert err_ef < 0.2 * err_plain, (err_ef, err_plain)
        pieces = np.array_split(np.arange(n), world)
        for g, ef in zip(gs, efs, strict=True):
            assert ef.residual is not None and np.isfinite(ef.residual).all()
            own = pieces[g.rank]
            assert not ef.residual[own].any(), "the own piece is never encoded"
            assert ef.residual[np.setdiff1d(np.arange(n), own)].any()


async def test_reduce_scatter_error_feedback_recovers_after_a_non_finite_step() -> None:
    n = 4096
    async with groups(2, config={"small_bytes": 1024}) as gs:
        efs = [ErrorFeedback() for _ in gs]
        for step in range(3):
            xs = [np.full(n, 1.0, np.float32) for _ in gs]
            if step == 0:
                xs[0][-1] = np.inf  # in rank 1's piece: rank 0 encodes it
            with np.errstate(over="ignore", invalid="ignore"):
                outs = await asyncio.gather(
                    *(
                        g.reduce_scatter(x, wire_dtype="int8", error_feedback=ef)
                        for g, x, ef in zip(gs, xs, efs, strict=True)
                    )
                )
            if step == 0:
                assert not np.isfinite(outs[1][-1])
                assert np.isfinite(outs[0]).all()
            else:
                for out in outs:
                    assert np.isfinite(out).all(), (step, np.flatnonzero(~np.isfinite(out)))
                    np.testing.assert_allclose(out, 2.0, rtol=1e-2)
        for ef in efs:
            assert ef.residual is not None and np.isfinite(ef.residual).all()
        with pytest.raises(UsageError, match="use one ErrorFeedback per tensor"):
            await gs[0].reduce_scatter(
                np.ones(8, np.float32), wire_dtype="int8", error_feedback=efs[0]
            )
        with pytest.raises(UsageError, match="needs a wire_dtype"):
            await gs[0].reduce_scatter(np.ones(8, np.float32), error_feedback=ErrorFeedback())


async def test_compression_usage_errors() -> None:
    async with groups(2) as gs:
        g = gs[0]
        with pytest.raises(UsageError, match="wire_dtype must be"):
            await g.all_reduce(np.ones(4, np.float32), wire_dtype="int4")
        with pytest.raises(UsageError, match="floating sum/mean"):
            await g.all_reduce(np.ones(4, np.int32), wire_dtype="int8")
        with pytest.raises(UsageError, match="floating sum/mean"):
            await g.all_reduce(np.ones(4, np.float32), op="max", wire_dtype="int8")
        with pytest.raises(UsageError, match="deterministic"):
            await g.all_reduce(np.ones(4), mode="deterministic", wire_dtype="float16")
        with pytest.raises(UsageError, match="needs a wire_dtype"):
            await g.all_reduce(np.ones(4), error_feedback=ErrorFeedback())
        with pytest.raises(UsageError, match="error_feedback must be an ErrorFeedback"):
            await g.all_reduce(np.ones(4), wire_dtype="int8", error_feedback=True)  # type: ignore[arg-type]
    async with Group.from_seed("test-seed-0123456789", rank=0, world=1) as solo:
        x = np.linspace(0, 1, 7, dtype=np.float32)
        assert np.array_equal(await solo.all_reduce(x, wire_dtype="int8"), x)


async def test_wire_dtype_may_be_a_numpy_type() -> None:
    import ml_dtypes

    xs = gaussian(2, 5000, seed=4)
    async with groups(2) as gs:
        for name, kind in (
            ("float16", np.float16),
            ("bfloat16", ml_dtypes.bfloat16),
            ("int8", np.dtype(np.int8)),
        ):
            by_name = await reduce_all(gs, xs, wire_dtype=name)
            by_type = await reduce_all(gs, xs, wire_dtype=kind)
            assert by_type[0].tobytes() == by_name[0].tobytes(), name
        for wrong in (np.float32, np.dtype(">f2"), np.float16(1.0), True, np.zeros(2)):
            with pytest.raises(UsageError, match="wire_dtype must be"):
                await gs[0].all_reduce(xs[0], wire_dtype=wrong)  # type: ignore[arg-type]


async def test_a_deterministic_group_default_says_where_it_came_from_and_the_way_out() -> None:
    """GroupConfig(mode="deterministic") and a call with a wire_dtype but no mode: the
    error names the group default (the caller passed no mode) and how to compress this
    call; that way works."""
    async with groups(2, config={"mode": "deterministic"}) as gs:
        with pytest.raises(UsageError, match=r"default mode is 'deterministic' \(GroupConfig"):
            await gs[0].all_reduce(np.ones(4), wire_dtype="int8")
        with pytest.raises(UsageError, match="pass mode='fast'"):
            await gs[0].reduce_scatter(np.ones(4), wire_dtype="bfloat16")
        outs = await asyncio.gather(
            *(g.all_reduce(np.ones(4), wire_dtype="int8", mode="fast") for g in gs)
        )
        assert all(np.allclose(o, 2.0, rtol=3e-2) for o in outs)


async def test_a_call_refused_for_its_timeout_leaves_input_and_residual_alone() -> None:
    """In place, a float32 mean divides the input before it is encoded, and error feedback
    updates its residual: a refused call must do neither, so that the same call retried
    with good arguments still gives the right result."""
    async with groups(2) as gs:
        xs = [np.full(8, 4.0, np.float32) for _ in gs]
        efs = [ErrorFeedback() for _ in gs]
        ys = [np.linspace(0, 1, 64, dtype=np.float32) + r for r in range(2)]
        for g in gs:
            with pytest.raises(UsageError, match="timeout"):
                await g.all_reduce(
                    xs[g.rank], op="mean", wire_dtype="bfloat16", out=xs[g.rank], timeout=0
                )
        assert all(np.array_equal(x, np.full(8, 4.0, np.float32)) for x in xs)
        means = await asyncio.gather(
            *(
                g.all_reduce(xs[g.rank], op="mean", wire_dtype="bfloat16", out=xs[g.rank])
                for g in gs
            )
        )
        assert all(np.array_equal(m, np.full(8, 4.0, np.float32)) for m in means)
        await asyncio.gather(
            *(g.all_reduce(ys[g.rank], wire_dtype="int8", error_feedback=efs[g.rank]) for g in gs)
        )
        kept = [ef.residual.copy() for ef in efs]  # type: ignore[union-attr]
        assert any(np.any(k != 0) for k in kept)
        for g in gs:
            with pytest.raises(UsageError, match="timeout"):
                await g.all_reduce(
                    ys[g.rank], wire_dtype="int8", error_feedback=efs[g.rank], timeout=-1
                )
        assert all(np.array_equal(ef.residual, k) for ef, k in zip(efs, kept, strict=True))


async def test_a_block_larger_than_the_array_needs_no_block_sized_scratch() -> None:
    """block >= n means one scale for the whole array: scratch is sized by the array."""
    from p2pdist.group.compress import make_codec

    codec = make_codec("int8", block=1 << 28)
    x = np.linspace(-1, 1, 10, dtype=np.float32)
    np.testing.assert_allclose(codec.decode(codec.encode(x), 10), x, atol=1 / 127)
    assert codec._tmp.nbytes <= 4 * 10  # type: ignore[attr-defined]
    async with groups(2) as gs:
        outs = await reduce_all(gs, [x, x], wire_dtype="int8", block=1 << 40)
        np.testing.assert_allclose(outs[0], 2 * x, atol=2 / 127)


async def test_float16_overflow_and_mean_underflow_under_raising_errstate() -> None:
    """A caller's np.errstate(all="raise") does not break the group: a float16 overflow
    gives the documented inf and a mean of subnormal inputs a tiny or zero result."""
    async with groups(2) as gs:
        big = [np.full(8, 1e5, np.float32)] * 2
        tiny = [np.full(8, 1e-44, np.float32)] * 2
        with np.errstate(all="raise"):
            outs = await reduce_all(gs, big, wire_dtype="float16")
            assert np.isinf(outs[0]).all()
            for wire in ("float16", "bfloat16", "int8"):
                means = await reduce_all(gs, tiny, op="mean", wire_dtype=wire)
                assert np.abs(means[0]).max() <= 2e-44
                efs = [ErrorFeedback(), ErrorFeedback()]
                await asyncio.gather(
                    *(
                        g.all_reduce(
                            tiny[g.rank], "mean", wire_dtype=wire, error_feedback=efs[g.rank]
                        )
                        for g in gs
                    )
                )
        assert all(g.broken is None for g in gs)


async def test_tiny_float16_results_and_a_rescaled_residual_under_raising_errstate() -> None:
    """Under np.errstate(all="raise"), a float16 result in float16's subnormal range (a
    small gradient divided by the world, an int8 block decoded) raised "underflow in
    cast" where the float32 result is written back, and a residual rescaled for a call
    with another op raised "underflow in multiply": either broke the group on every rank
    (an audit). They now round, as the docs promise."""
    grads = np.array([6e-8, 1.0], np.float16)
    tiny = np.array([2e-6, 6e-8], np.float16)
    async with groups(3) as gs:
        with np.errstate(all="raise"):
            for wire in ("float16", "bfloat16"):
                parts = await asyncio.gather(
                    *(g.reduce_scatter(np.tile(grads, 3), op="mean", wire_dtype=wire) for g in gs)
                )
                assert parts[0].dtype == np.float16 and abs(float(parts[0][1]) - 1) < 0.01
                means = await reduce_all(gs, [grads] * 3, op="mean", wire_dtype=wire)
                assert abs(float(means[0][1]) - 1) < 0.01
            sums = await reduce_all(gs, [tiny] * 3, wire_dtype="int8")
            assert sums[0].dtype == np.float16 and abs(float(sums[0][0]) - 6e-6) < 1e-7
            efs = [ErrorFeedback() for _ in gs]
            x = np.zeros(256, np.float32)
            x[0], x[1] = 1.0, 1e-39  # int8 loses 1e-39: the residual keeps it
            for op in ("sum", "mean"):  # the residual is rescaled for mean's units
                await asyncio.gather(
                    *(
                        g.all_reduce(x, op=op, wire_dtype="int8", error_feedback=efs[g.rank])
                        for g in gs
                    )
                )
        assert all(g.broken is None for g in gs)


async def test_float64_and_float16_edges_under_raising_errstate() -> None:
    """float64 input beyond float32's range (1e-50, 1e39) raised FloatingPointError on
    its rank alone, before the collective, and the other rank waited out its timeout;
    a float16 sum past 65504 broke the group. Now: what the casts give (0, inf)."""
    x64 = np.ones(16)
    x64[3], x64[5] = 1e-50, 1e39
    x16 = np.full(7, 40000, np.float16)
    async with groups(2) as gs:
        with np.errstate(all="raise"):
            for wire in ("float16", "bfloat16", "int8"):
                outs = await reduce_all(gs, [x64, x64], wire_dtype=wire, timeout=10)
                assert outs[0].dtype == np.float64 and outs[0][0] == 2
                assert outs[0][3] == 0
                efs = [ErrorFeedback(), ErrorFeedback()]
                await asyncio.gather(
                    *(g.all_reduce(x64, wire_dtype=wire, error_feedback=efs[g.rank]) for g in gs)
                )
            outs = await reduce_all(gs, [x16, x16], wire_dtype="bfloat16", timeout=10)
            assert outs[0].dtype == np.float16 and np.isinf(outs[0]).all()
        assert all(g.broken is None for g in gs)


async def test_bfloat16_overflow_and_int8_underflow_under_raising_errstate() -> None:
    """Under np.errstate(all="raise") a bfloat16 sum past float32's range and an int8
    block whose small elements scale below float32's smallest raised FloatingPointError
    inside the collective and broke the group; now inf and the documented rounding."""
    big = np.full(4, 3e38, np.float32)
    mixed = np.array([1e3, 1e-45] * 128, np.float32)
    async with groups(2) as gs:
        with np.errstate(all="raise"):
            outs = await reduce_all(gs, [big, big], wire_dtype="bfloat16", timeout=10)
            assert np.isinf(outs[0]).all()
            outs = await reduce_all(gs, [mixed, mixed], wire_dtype="int8", timeout=10)
            np.testing.assert_allclose(outs[0][::2], 2e3, rtol=1e-2)
        assert all(g.broken is None for g in gs)


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("raising", [True, False])
async def test_opposite_infinities_sum_to_nan_without_error_or_warning(
    wire: str, raising: bool
) -> None:
    """+inf from one rank and -inf from another (gradients of a diverged mixed-precision
    step): the element's sum is NaN, on every wire and call, on the small path and the
    ring, and the group goes on. Under the caller's np.errstate(all="raise") the float16
    and bfloat16 partial sums raised FloatingPointError and broke the group; under
    numpy's defaults they warned from inside the library."""
    import warnings

    async with groups(3) as gs:
        for n in (5, 100_003):  # one round, and the ring
            xs = [np.ones(n, np.float32) for _ in gs]
            xs[0][1], xs[1][1] = np.inf, -np.inf
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with np.errstate(all="raise") if raising else np.errstate():
                    outs = await reduce_all(gs, xs, wire_dtype=wire, timeout=10)
                    pieces = await asyncio.gather(
                        *(g.reduce_scatter(xs[g.rank], wire_dtype=wire, timeout=10) for g in gs)
                    )
                    roots = await asyncio.gather(
                        *(g.reduce(xs[g.rank], 0, wire_dtype=wire, timeout=10) for g in gs)
                    )
            for out in outs:
                assert np.isnan(out[1]) and np.isfinite(np.delete(out, 1)).all(), wire
            assert np.isnan(pieces[0][1]) and np.isnan(roots[0][1])
            assert np.isfinite(np.concatenate(pieces[1:])).all()
        assert all(g.broken is None for g in gs)
        await asyncio.gather(*(g.barrier() for g in gs))


@pytest.mark.parametrize("route", ["bits", "numpy"])
def test_float16_partial_sums_of_opposite_infinities_on_either_route(route: str) -> None:
    from p2pdist.group.compress import make_codec

    codec = make_codec("float16", f16_route=route)
    acc = np.array([np.inf, 1.0, 0.0], np.float32)
    with np.errstate(all="raise"):  # (1e-45 is below float16's least: 0, not an error)
        codec.accumulate(codec.encode(np.array([-np.inf, 2.0, 1e-45], np.float32)), acc)
    assert np.isnan(acc[0]) and acc[1] == 3.0 and acc[2] == 0.0


def test_int8_block_may_be_a_numpy_integer() -> None:
    from p2pdist.group.compress import make_codec

    assert make_codec("int8", np.int64(256)).nbytes(512) == make_codec("int8", 256).nbytes(512)
    with pytest.raises(UsageError):
        make_codec("int8", np.float64(256))


def test_float16_decode_is_exact_when_the_cpu_flushes_subnormals(tmp_path: object) -> None:
    """With FTZ/DAZ set (as -ffast-math libraries or torch.set_flush_denormal do), the
    float16 wire still decodes subnormals exactly (numpy's cast takes over)."""
    import ctypes
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from p2pdist.group.compress import make_codec
    from p2pdist.group.halfcast import subnormals_flushed

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform != "linux" or not hasattr(np, "float16"):
        pytest.skip("needs a C compiler on Linux x86-64 to set MXCSR (FTZ/DAZ)")
    src = Path(str(tmp_path)) / "daz.c"
    src.write_text(
        "#include <xmmintrin.h>\n"
        "unsigned get(void){return _mm_getcsr();}\n"
        "void set(unsigned v){_mm_setcsr(v);}\n"
    )
    lib = src.with_suffix(".so")
    build = [cc, "-shared", "-fPIC", "-o", str(lib), str(src)]
    built = subprocess.run(build, capture_output=True, timeout=60)
    if built.returncode != 0:
        pytest.skip(f"cannot build the MXCSR helper: {built.stderr.decode()[:200]}")
    csr = ctypes.CDLL(str(lib))
    csr.get.restype = ctypes.c_uint
    h = np.arange(1, 1024, dtype=np.uint16)  # every positive float16 subnormal
    want = h.view(np.float16).astype(np.float32)
    codec = make_codec("float16")
    saved = csr.get()
    try:
        csr.set(ctypes.c_uint(saved | 0x8040))  # FTZ | DAZ
        assert subnormals_flushed()
        got = codec.decode(h.tobytes(), h.size)
    finally:
        csr.set(ctypes.c_uint(saved))
    assert not subnormals_flushed()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
async def test_reduce_scatter_compressed_within_the_bound(world: int, wire: str) -> None:
    # chunk_bytes 4096: many chunks per piece, pieces whose starts are off the int8 blocks
    async with groups(world, config={"chunk_bytes": 4096}) as gs:
        for shape in [(world - 1,), (1001,), (40_001,), (3001, 3)]:
            xs = gaussian(world, int(np.prod(shape)), seed=shape[0])
            xs = [x.reshape(shape) for x in xs]
            ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
            scale = max(float(np.abs(ref).max()), 1e-30)
            for op in ("sum", "mean"):
                outs = await asyncio.gather(
                    *(g.reduce_scatter(xs[g.rank], op, wire_dtype=wire, block=128) for g in gs)
                )
                want = np.array_split(ref / (world if op == "mean" else 1), world)
                for r, piece in enumerate(outs):
                    assert piece.dtype == np.float32 and piece.shape == want[r].shape
                    err = float(np.abs(piece - want[r]).max(initial=0)) * (
                        world if op == "mean" else 1
                    )
                    assert err / scale <= BOUNDS[wire], (wire, shape, op, r, err / scale)


async def test_reduce_scatter_compressed_sends_fewer_bytes_and_keeps_its_dtype() -> None:
    async with groups(2) as gs:
        xs = gaussian(2, 1 << 20)

        async def sent_for(**kw: object) -> int:
            before = gs[0].connection(1).stats.bytes_sent
            await asyncio.gather(*(g.reduce_scatter(xs[g.rank], **kw) for g in gs))  # type: ignore[arg-type]
            return gs[0].connection(1).stats.bytes_sent - before

        plain = await sent_for()
        assert abs(await sent_for(wire_dtype="bfloat16") / plain - 0.5) < 0.01
        assert abs(await sent_for(wire_dtype="int8") / plain - (1 + 4 / 256) / 4) < 0.01
        halves = [x.astype(np.float16) for x in xs]
        outs = await asyncio.gather(
            *(g.reduce_scatter(halves[g.rank], wire_dtype="float16") for g in gs)
        )
        ref = np.sum([h.astype(np.float64) for h in halves], axis=0)
        assert outs[1].dtype == np.float16
        np.testing.assert_allclose(outs[1], np.array_split(ref, 2)[1], atol=2e-2, rtol=2e-3)


async def test_reduce_scatter_compression_must_agree_and_is_checked() -> None:
    async with groups(2, timeout=5.0) as gs:
        x = np.ones(10_000, np.float32)
        results = await asyncio.gather(
            gs[0].reduce_scatter(x, wire_dtype="int8"),
            gs[1].reduce_scatter(x),
            return_exceptions=True,
        )
        assert all(isinstance(r, Exception) for r in results), results
        assert any(isinstance(r, MismatchError) and "int8" in str(r) for r in results), results
    async with groups(2) as gs:
        with pytest.raises(UsageError, match="floating sum/mean"):
            await gs[0].reduce_scatter(np.ones(4, np.float32), op="max", wire_dtype="bfloat16")
        with pytest.raises(UsageError, match="deterministic"):
            await gs[0].reduce_scatter(np.ones(4), mode="deterministic", wire_dtype="int8")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
async def test_reduce_compressed_within_the_bound_on_every_root(world: int, wire: str) -> None:
    async with groups(world, config={"chunk_bytes": 4096}) as gs:
        for shape in [(world - 1,), (40_001,), (3001, 3)]:
            xs = [x.reshape(shape) for x in gaussian(world, int(np.prod(shape)), seed=7)]
            ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
            scale = max(float(np.abs(ref).max()), 1e-30)
            for dst in range(world):
                op = "mean" if dst % 2 else "sum"
                outs = await asyncio.gather(
                    *(g.reduce(xs[g.rank], dst, op, wire_dtype=wire, block=128) for g in gs)
                )
                assert all(o is None for r, o in enumerate(outs) if r != dst)
                got = outs[dst]
                assert got is not None and got.dtype == np.float32 and got.shape == shape
                want = ref / (world if op == "mean" else 1)
                err = float(np.abs(got - want).max(initial=0)) * (world if op == "mean" else 1)
                assert err / scale <= BOUNDS[wire], (wire, shape, dst, op, err / scale)


async def test_reduce_compressed_sends_fewer_bytes_and_is_checked() -> None:
    async with groups(2) as gs:
        xs = gaussian(2, 1 << 20)

        async def sent_by_rank_1(**kw: object) -> int:
            before = gs[1].connection(0).stats.bytes_sent
            await asyncio.gather(*(g.reduce(xs[g.rank], 0, **kw) for g in gs))  # type: ignore[arg-type]
            return gs[1].connection(0).stats.bytes_sent - before

        plain = await sent_by_rank_1()
        assert abs(await sent_by_rank_1(wire_dtype="bfloat16") / plain - 0.5) < 0.01
        assert abs(await sent_by_rank_1(wire_dtype="int8") / plain - (1 + 4 / 256) / 4) < 0.01
    async with groups(2, timeout=5.0) as gs:
        x = np.ones(10_000, np.float32)
        results = await asyncio.gather(
            gs[0].reduce(x, 0, wire_dtype="bfloat16"), gs[1].reduce(x, 0), return_exceptions=True
        )
        assert any(isinstance(r, MismatchError) and "bfloat16" in str(r) for r in results)
    async with groups(2) as gs:
        with pytest.raises(UsageError, match="floating sum/mean"):
            await gs[0].reduce(np.ones(4, np.int64), 0, wire_dtype="int8")


async def test_reduce_compressed_edges_and_out() -> None:
    """0-d, empty and one-element inputs (ranks, dst among them, with empty pieces),
    float16 and float64 results, int8 blocks off the pieces' edges, out=x on dst."""
    for world in (2, 3):
        async with groups(world) as gs:
            cases = [
                [np.array(r + 1.0, np.float32) for r in range(world)],
                [np.zeros(0, np.float32) for _ in range(world)],
                [np.zeros((2, 0), np.float32) for _ in range(world)],
                [np.array([r + 1.0], np.float32) for r in range(world)],
                [np.full(7, r + 1.0, np.float16) for r in range(world)],
                [np.full(7, r + 1.0, np.float64) for r in range(world)],
            ]
            for xs in cases:
                want = np.sum([x.astype(np.float64) for x in xs], axis=0)
                for dst in range(world):
                    for op in ("sum", "mean"):
                        outs = await asyncio.gather(
                            *(g.reduce(xs[g.rank], dst, op, wire_dtype="int8", block=4) for g in gs)
                        )
                        got = outs[dst]
                        assert got is not None and got.shape == xs[0].shape
                        assert got.dtype == xs[0].dtype
                        np.testing.assert_allclose(got, want / (world if op == "mean" else 1), 1e-2)
                        assert all(o is None for r, o in enumerate(outs) if r != dst)
            xs = [np.arange(10, dtype=np.float32) + r for r in range(world)]
            before = [x.copy() for x in xs]
            outs = await asyncio.gather(
                *(
                    g.reduce(
                        xs[g.rank],
                        1,
                        "mean",
                        out=xs[g.rank] if g.rank == 1 else None,
                        wire_dtype="bfloat16",
                    )
                    for g in gs
                )
            )
            assert outs[1] is xs[1]
            np.testing.assert_allclose(xs[1], np.mean(before, axis=0), rtol=1e-2)
            for r in range(world):
                if r != 1:
                    np.testing.assert_array_equal(xs[r], before[r])  # the others' inputs kept
