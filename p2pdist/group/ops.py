"""Reduction operators and the checks that decide where each one is meaningful."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["ReduceOp", "divide_in_place", "multiply_complex_into", "reduce_op"]


@dataclass(frozen=True, slots=True)
class ReduceOp:
    """A named elementwise reduction (``ufunc``), plus division by the world for mean."""

    name: str
    ufunc: np.ufunc
    divide: bool = False

    def combine(self, acc: np.ndarray, other: np.ndarray) -> None:
        """``acc = acc (op) other`` in place, in ``acc``'s dtype (no temporaries)."""
        self.ufunc(acc, other, out=acc)

    def finish(self, result: np.ndarray, world: int) -> None:
        """Final in-place step (mean divides by ``world``)."""
        if self.divide and world > 1:
            divide_in_place(result, world)


def divide_in_place(result: np.ndarray, world: int) -> None:
    """``result /= world``; a complex array part by part (numpy divides a complex by
    ``complex(world)``, which turns an infinite part into NaN in the other)."""
    if result.dtype.kind == "c":
        for part in (result.real, result.imag):
            np.divide(part, part.dtype.type(world), out=part)
    else:
        np.divide(result, result.dtype.type(world), out=result)


def multiply_complex_into(acc: np.ndarray, x: np.ndarray) -> None:
    """``acc *= x`` for complex arrays as ``(ac - bd) + (ad + bc)i``, every real operation
    rounded: the same bits for an element whatever the array's length (numpy's complex
    multiply takes other routes, with other last bits, for other lengths)."""
    a, b, c, d = acc.real, acc.imag, x.real, x.imag
    re = a * c
    re -= b * d
    im = a * d
    im += b * c
    a[...] = re
    b[...] = im


_OPS = {
    "sum": ReduceOp("sum", np.add),
    "prod": ReduceOp("prod", np.multiply),
    "max": ReduceOp("max", np.maximum),
    "min": ReduceOp("min", np.minimum),
    "mean": ReduceOp("mean", np.add, divide=True),
}


def reduce_op(name: str, dtype: np.dtype[Any]) -> ReduceOp:
    """Look up ``name`` and check it makes sense for ``dtype``."""
    try:
        op = _OPS[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown op {name!r}; choose one of {sorted(_OPS)}") from None
    if op.divide and dtype.kind not in "fc":
        raise UsageError(
            f"op='mean' needs a floating dtype, got {dtype}; use op='sum' and divide yourself"
        )
    if dtype.kind == "c" and name in ("max", "min"):
        raise UsageError(f"op={name!r} is not defined for complex dtype {dtype}")
    return op
