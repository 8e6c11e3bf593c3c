"""Array headers: how an ndarray's dtype and shape travel next to its raw bytes.

Only plain numeric and boolean dtypes are accepted; object, structured and void dtypes
are refused, so nothing received is ever unpickled or interpreted as Python objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_NDIM",
    "ArrayHeader",
    "ArrayHeaderError",
    "WIRE_DTYPES",
    "check_dtype",
    "check_shape",
]


def _code(dtype: np.dtype[Any]) -> str:
    """A dtype's type code without its byte order: ``f4``, ``b1``."""
    return dtype.str.lstrip("<>|=")


WIRE_DTYPES = frozenset(
    _code(np.dtype(t))
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
MAX_NDIM = 32
MAX_NBYTES = 1 << 62
"""Largest array a header may describe, bytes (so sizes never overflow int64)."""


class ArrayHeaderError(ValueError):
    """An array header is malformed or names a refused dtype."""


def check_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """Return the little-endian wire form of ``dtype`` or raise for refused dtypes."""
    dt = np.dtype(dtype)
    if _code(dt) not in WIRE_DTYPES:
        hint = ""
        if dt.name == "bfloat16":  # ml_dtypes': numeric, but not a numpy dtype
            hint = (
                "; reduce x.astype(np.float32) with wire_dtype='bfloat16' (bfloat16 on "
                "the wire), or move the bits as x.view(np.uint16) (broadcast, gather, "
                "send/recv)"
            )
        raise ArrayHeaderError(
            f"dtype {dt} cannot travel on the wire (bool, integers, float16/32/64 and "
            f"complex64/128 only){hint}"
        )
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


def check_shape(dt: np.dtype[Any], dims: Sequence[int]) -> None:
    """Refuse (ArrayHeaderError) a shape that cannot travel: more than :data:`MAX_NDIM`
    dimensions, or an extent (the dimensions, zeros counted as one) past
    :data:`MAX_NBYTES`: numpy refuses to make such an array when its extent overflows,
    even when a dimension is 0, so the receiver cannot allocate it. The sender (and a
    receiver that expects such a shape) refuses it first: else the receiver's refusal
    would break the connection, or the receiver would wait for what cannot come."""
    if len(dims) > MAX_NDIM:
        raise ArrayHeaderError(f"array has {len(dims)} dimensions; at most {MAX_NDIM} travel")
    if math.prod(max(d, 1) for d in dims) * dt.itemsize > MAX_NBYTES:
        raise ArrayHeaderError(f"array {dt.name}{list(dims)} is too large")


@dataclass(frozen=True, slots=True)
class ArrayHeader:
    """dtype and shape of an array whose raw C-order bytes follow."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, arr: np.ndarray) -> ArrayHeader:
        """Header for ``arr`` (which must be C-contiguous little/native-endian)."""
        if arr.dtype.byteorder == ">":
            raise ArrayHeaderError(f"array of {arr.dtype} is big-endian; convert it first")
        if not arr.flags.c_contiguous:
            raise ArrayHeaderError("array is not C-contiguous; copy it first")
        dt, dims = check_dtype(arr.dtype), tuple(int(s) for s in arr.shape)
        check_shape(dt, dims)  # as the receiver does: an empty array may still be refused
        return cls(dt, dims)

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize  # exact: no int64 overflow

    def to_wire(self) -> list[Any]:
        """A msgpack-ready value."""
        return ["<" + _code(self.dtype), list(self.shape)]

    @classmethod
    def from_wire(cls, obj: Any) -> ArrayHeader:
        """Validate and parse a value produced by :meth:`to_wire`."""
        if not (isinstance(obj, list | tuple) and len(obj) == 2):
            raise ArrayHeaderError("array header must be [dtype, shape]")
        code, shape = obj
        if not isinstance(code, str) or len(code) > 8:
            raise ArrayHeaderError("array dtype must be a short string")
        order, base = (code[0], code[1:]) if code[:1] in ("<", ">", "|", "=") else ("<", code)
        if base not in WIRE_DTYPES:
            raise ArrayHeaderError(f"refused dtype {code!r}")
        if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
            raise ArrayHeaderError("array shape must be a list of at most 32 ints")
        dims: list[int] = []
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0 or d > 1 << 62:
                raise ArrayHeaderError(f"bad array dimension {d!r}")
            dims.append(d)
        dt = np.dtype(order + base)
        check_shape(dt, dims)
        return cls(dt, tuple(dims))

    def describe(self) -> str:
        """Human form such as ``float32[4, 3]``."""
        return f"{self.dtype.name}{list(self.shape)}"

    def view(self, payload: memoryview) -> np.ndarray:
        """Interpret ``payload`` as this array without copying; checks the byte count."""
        if payload.nbytes != self.nbytes:
            raise ArrayHeaderError(
                f"payload of {payload.nbytes} bytes does not match {self.describe()} "
                f"({self.nbytes} bytes)"
            )
        flat = np.frombuffer(payload, dtype=self.dtype) if self.nbytes else np.empty(0, self.dtype)
        return flat.reshape(self.shape)
