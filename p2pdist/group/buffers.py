"""Checks and buffers for the arrays collectives take and return."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError
from ..wire.arrays import WIRE_DTYPES, ArrayHeaderError, check_dtype, check_shape

__all__ = ["as_array", "expectation", "is_plain_array", "mismatch", "result_buffer", "wire_form"]


_NATIVE = frozenset(np.dtype("<" + code) for code in WIRE_DTYPES)
"""The wire dtypes in little-endian order: they travel as they are (the fast path)."""


def is_plain_array(x: object) -> bool:
    """Whether ``x`` is an ndarray that a collective may fill or reduce in place: not a
    masked array (its mask cannot travel) nor an ``np.matrix`` (it stays 2-D when
    flattened); other subclasses (``np.memmap``) behave as plain arrays do."""
    return isinstance(x, np.ndarray) and not isinstance(x, np.matrix | np.ma.MaskedArray)


def wire_form(dtype: Any) -> np.dtype[Any]:
    """``dtype`` in its little-endian wire form (``>f4`` gives ``float32``); a dtype that
    cannot travel (object, str, structured, datetime, ...) is a :class:`UsageError`."""
    try:
        return check_dtype(dtype)
    except ArrayHeaderError as exc:
        raise UsageError(str(exc)) from None


def as_array(x: Any) -> np.ndarray:
    """A C-contiguous ndarray view of ``x`` (copying only when needed), dtype checked."""
    if (
        (type(x) is np.ndarray or type(x) is np.memmap)
        and x.dtype in _NATIVE
        and x.flags.c_contiguous
    ):
        # The usual case, checked in one go. A memmap stays itself (its rules are the
        # plain array's), so that out=m is the input itself, as the caller wrote it.
        return x
    if isinstance(x, np.ma.MaskedArray):  # its mask would be dropped on the wire
        raise UsageError(
            "masked arrays are not supported: pass x.filled(value) (or x.data to reduce "
            "the masked values too)"
        )
    if type(x) is not np.ndarray:
        if hasattr(x, "__cuda_array_interface__"):  # the Group's methods stage CuPy arrays
            name = f"{type(x).__module__}.{type(x).__qualname__}"
            raise UsageError(
                f"this call takes numpy arrays, not {name} (the Group's collectives, "
                "send/recv and GradientBuckets take CuPy arrays)"
            )
        x = np.asarray(x)  # a subclass (np.matrix, say) too: its own rules would not hold
    wire_form(x.dtype)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    return x if x.flags.c_contiguous else np.array(x, order="C")  # keeps 0-d arrays 0-d


def result_buffer(
    source: np.ndarray | None, shape: tuple[int, ...], dtype: Any, out: np.ndarray | None
) -> np.ndarray:
    """``out`` checked for shape and dtype, or a fresh buffer (``source`` itself when
    ``out`` is ``source`` under another array object, as ``x[:]``: the call is in place).

    ``dtype`` is the result's (little-endian) wire dtype. A big-endian ``out`` is refused
    with a :class:`UsageError` saying so: the collective works in ``out`` itself, in
    little-endian order, so it cannot fill a big-endian buffer in place.
    """
    if out is None:
        try:
            return np.empty(shape, dtype)
        except ValueError as exc:  # an extent numpy cannot make, as (size, 0, 2**62)
            raise UsageError(f"the result, {np.dtype(dtype)}{list(shape)}: {exc}") from None
    if not is_plain_array(out):
        raise UsageError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype.byteorder == ">" and out.dtype.newbyteorder("<") == dtype:
        raise UsageError(
            f"out is big-endian ({out.dtype.str}); collectives write their result in "
            f"little-endian order: pass a {np.dtype(dtype).str} out (or none) and convert "
            "the result afterwards"
        )
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise UsageError(
            f"out has {out.dtype}{list(out.shape)}, the result is {np.dtype(dtype)}{list(shape)}"
        )
    flags = out.flags  # a new object on every access
    if not flags.c_contiguous or not flags.writeable:
        raise UsageError("out must be a writeable C-contiguous array")
    if source is not None and out is not source and np.shares_memory(out, source):
        if _same_place(out, source):
            return source  # out=x[:] or x.reshape(...) of the same shape: in place
        raise UsageError("out overlaps the input without being the same array")
    return out


def _same_place(out: np.ndarray, source: np.ndarray) -> bool:
    """Whether ``out`` is ``source`` under another array object (``x[:]``, a reshape to
    the same shape): the same first byte, shape, strides and dtype, and writeable."""
    return (
        out.__array_interface__["data"][0] == source.__array_interface__["data"][0]
        and out.shape == source.shape
        and out.strides == source.strides
        and out.dtype == source.dtype
        and bool(source.flags.writeable)
    )


def expectation(
    like: np.ndarray | None, shape: Sequence[int] | None, dtype: Any, out: np.ndarray | None
) -> tuple[np.dtype[Any] | None, tuple[int, ...] | None]:
    """The dtype (in little-endian wire form) and shape a recv expects, checked before the
    recv takes its message: a dtype that cannot travel is a :class:`UsageError` here.

    Byte order is not part of what is expected: ``dtype=">f4"`` or a big-endian ``like``
    match a float32 message (the result is little-endian float32), and a big-endian
    ``out`` is filled with the right values (the received bytes are swapped in place).
    """
    if out is not None and not is_plain_array(out):
        raise UsageError(f"out must be a numpy array, got {type(out).__name__}")
    if like is not None and not isinstance(like, np.ndarray):
        like = as_array(like)  # a list is fine: only its dtype and shape are used
    ref = like if like is not None else out  # and out, if given, must match like
    want_dtype = (ref.dtype if ref is not None else None) if dtype is None else _dtype(dtype)
    if want_dtype is not None:
        want_dtype = wire_form(want_dtype)
    if shape is not None:
        want_shape: tuple[int, ...] | None = _shape(shape)
    else:
        want_shape = tuple(ref.shape) if ref is not None else None
    if want_shape is not None:  # what no sender can send: refused, not waited for
        try:
            check_shape(want_dtype or np.dtype(np.uint8), want_shape)
        except ArrayHeaderError as exc:
            raise UsageError(f"recv expects what cannot travel: {exc}") from None
    if out is not None:
        asked = mismatch(wire_form(out.dtype), out.shape, want_dtype, want_shape)
        if asked:
            raise UsageError(f"out has {out.dtype}{list(out.shape)} but {asked} was asked for")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise UsageError("out must be a writeable C-contiguous array")
    return want_dtype, want_shape


def mismatch(
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    want_dtype: np.dtype[Any] | None,
    want_shape: tuple[int, ...] | None,
) -> str:
    """What of ``want_dtype`` / ``want_shape`` (None: anything) ``dtype`` and ``shape``
    do not match, as "dtype X and shape [..]"; empty when both match. ``dtype`` is
    compared as given: pass it in wire form, as ``want_dtype`` is."""
    asked = []
    if want_dtype is not None and dtype != want_dtype:
        asked.append(f"dtype {want_dtype}")
    if want_shape is not None and tuple(shape) != want_shape:
        asked.append(f"shape {list(want_shape)}")
    return " and ".join(asked)


def _dtype(dtype: Any) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] = np.dtype(dtype)
    except TypeError as exc:
        raise UsageError(f"dtype {dtype!r} is not a numpy dtype: {exc}") from None
    return result


def _shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (an int is a 1-D shape, as in numpy)."""
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise UsageError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in out):
        raise UsageError(f"shape must not be negative, got {shape!r}")
    return out
