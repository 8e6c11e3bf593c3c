"""Deterministic reductions: every input folded in rank order in float64 and rounded
once, so the result has the same bits on every rank and in every run, whatever the
arrival timing (``mode="deterministic"``, docs/collectives.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .algorithms import ahead, pairwise_rounds
from .linkops import Link, as_bytes, chunks, rank_ordered, send_to_others, view_as
from .ops import ReduceOp, multiply_complex_into

__all__ = ["fold_scratch", "ordered_all_reduce", "ordered_reduce", "ordered_reduce_scatter"]


_FOLD_BLOCK = 32 * 1024
"""Elements per float64 block of :func:`ordered_reduce` (256 KiB: stays in L2)."""


def fold_scratch(dtype: np.dtype[Any], n: int) -> np.ndarray:
    """Scratch for :func:`ordered_reduce` of up to ``n`` elements of ``dtype``."""
    wide = np.promote_types(dtype, np.float64)
    return np.empty((2, min(_FOLD_BLOCK, max(n, 1))), wide)


def ordered_reduce(
    parts: list[np.ndarray],
    op: ReduceOp,
    world: int,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """``out = round(parts[0] (op) parts[1] (op) ...)``, folded left to right in float64
    (complex128 for complex), in cache-sized blocks, rounded once into ``out``.

    Each block widens its inputs into ``scratch`` (from :func:`fold_scratch`; made here
    when None) with plain casts and folds them with same-dtype ufuncs: the same float64
    operations as ``op.ufunc(acc, part, dtype=float64)``, without the buffered mixed-dtype
    loops (in about 20% less time, docs/collectives.md)."""
    if (
        len(parts) == 2
        and (op.ufunc is np.add or op.ufunc is np.multiply)
        and not op.divide
        and out.dtype.kind == "f"
        and out.dtype.itemsize <= 4
    ):
        # One float64 add or multiply of two float32 (or float16) values, rounded to
        # float32, is the correctly rounded float32 operation itself (53 >= 2 * 24 + 2
        # bits: double rounding is innocuous; numpy's float16 loops compute in float32,
        # 24 >= 2 * 11 + 2). Same bits, no casts. Not max or min: which of +0 and -0
        # they keep depends on the loop (numpy's float16 one keeps the other one).
        op.ufunc(parts[0], parts[1], out=out)
        _one_nan(out)
        return
    if scratch is None:
        scratch = fold_scratch(out.dtype, out.size)
    wide = scratch.dtype
    block = scratch.shape[1]
    complex_product = wide.kind == "c" and op.ufunc is np.multiply
    for s0 in range(0, out.size, block):
        s1 = min(s0 + block, out.size)
        acc, tmp = scratch[0, : s1 - s0], scratch[1, : s1 - s0]
        np.copyto(acc, parts[0][s0:s1])  # widening: exact
        for part in parts[1:]:
            piece = part[s0:s1]
            if piece.dtype != wide:
                np.copyto(tmp, piece)
                piece = tmp
            if complex_product:
                multiply_complex_into(acc, piece)
            else:
                op.ufunc(acc, piece, out=acc)
        op.finish(acc, world)
        np.copyto(out[s0:s1], acc, casting="same_kind")  # the single rounding
        _one_nan(out[s0:s1])


def _one_nan(out: np.ndarray) -> None:
    """Every NaN in ``out`` (each part of a complex) made numpy's own quiet NaN.

    Which operand's NaN a ufunc passes on (its sign and payload) depends on where an
    element falls in numpy's vector loops, so on the chunk size and the path: the one
    NaN keeps the result's bits independent of both (a max over ``out``: a folded block,
    in cache, or a two-input add's whole chunk)."""
    if out.dtype.kind not in "fc" or out.size == 0:
        return
    parts = out.view(out.real.dtype) if out.dtype.kind == "c" else out  # (1-D, contiguous)
    if parts.dtype == np.float16:  # numpy does not vectorise float16: look at the bits
        found = np.max(parts.view(np.uint16) & 0x7FFF) > 0x7C00
    else:  # a NaN wins a max, in half the time of isnan's pass and its temporary
        found = np.isnan(parts.max())
    if found:
        np.copyto(parts, np.nan, where=np.isnan(parts))


async def ordered_all_reduce(link: Link, flat: np.ndarray, op: ReduceOp, out: np.ndarray) -> None:
    """Deterministic one-round all-reduce for small arrays: everyone sends everything,
    everyone folds all inputs in rank order in float64 (same bits everywhere)."""
    await send_to_others(link, as_bytes(flat))
    ordered_reduce(await rank_ordered(link, flat), op, link.size, out)


async def ordered_reduce_scatter(
    link: Link,
    flat: np.ndarray,
    bounds: list[tuple[int, int]],
    op: ReduceOp,
    chunk: int,
    out: np.ndarray,
) -> None:
    """Deterministic reduce-scatter: this rank's segment, reduced in rank order in float64.

    Every rank sends segment p of its input straight to rank p. The owner folds the
    contributions in the fixed order rank 0, 1, ..., n-1 in float64 (complex128 for complex
    inputs) and rounds once into ``out`` (its segment, in the input dtype), so the result
    does not depend on arrival timing, on where a ring would start, or on chunk sizes.
    """
    n, r = link.size, link.rank
    item = flat.dtype.itemsize
    pieces = [chunks(a, b, chunk) for a, b in bounds]
    a, b = bounds[r]
    scratch = fold_scratch(flat.dtype, min(chunk, b - a))

    async def send(i: int) -> None:
        for p in range(n):
            if p != r and i < len(pieces[p]):
                c0, c1 = pieces[p][i]
                await link.send(p, as_bytes(flat[c0:c1]))

    async def fold(i: int) -> None:
        if i < len(pieces[r]):
            c0, c1 = pieces[r][i]
            parts = [
                flat[c0:c1] if p == r else view_as(await link.recv(p, (c1 - c0) * item), flat.dtype)
                for p in range(n)
            ]
            ordered_reduce(parts, op, n, out[c0 - a : c1 - a], scratch)

    # Chunk i+1 of every other rank's piece goes before our chunk i is folded, so the next
    # chunks travel while this one is folded; on long round trips sends run further ahead
    # (algorithms.ahead).
    others = [p for p in range(n) if p != r]
    rounds = max(len(c) for c in pieces)
    await pairwise_rounds(rounds, rounds, ahead(link, others, chunk * item) + 1, send, fold)
