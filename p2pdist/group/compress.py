"""Wire codecs for compressed reductions: float16, bfloat16 (via ml_dtypes), int8 + scales.

A codec turns float32 values into the bytes a compressed collective sends and back.
Accumulation always happens in float32 on the receiving rank; only the wire is narrow.

Bytes on the wire per element: float16 and bfloat16 2; int8 1 + 4/block (one float32
absmax scale per block of ``block`` elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from ..errors import UsageError

__all__ = ["WIRE_DTYPES", "ErrorFeedback", "WireCodec", "make_codec"]

WIRE_DTYPES = ("float16", "bfloat16", "int8")


class WireCodec(Protocol):
    """float32 <-> wire bytes for one compressed collective."""

    @property
    def name(self) -> str:
        """The wire dtype's name."""
        ...

    def nbytes(self, n: int) -> int:
        """Encoded size of ``n`` elements."""
        ...

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Encode float32 ``x`` (1-D) into a uint8-viewable array of ``nbytes(x.size)``."""
        ...

    def decode(self, data: Any, n: int) -> np.ndarray:
        """Decode ``n`` elements from ``data`` (bytes-like) into a new float32 array."""
        ...


@dataclass(frozen=True, slots=True)
class _CastCodec:
    """A plain narrowing cast (float16 through numpy, bfloat16 through ml_dtypes)."""

    name: str
    dtype: np.dtype[Any]

    def nbytes(self, n: int) -> int:
        return n * 2

    def encode(self, x: np.ndarray) -> np.ndarray:
        return x.astype(self.dtype).view(np.uint8)  # bfloat16 exports no buffer format

    def decode(self, data: Any, n: int) -> np.ndarray:
        return np.frombuffer(data, self.dtype, n).astype(np.float32)


@dataclass(frozen=True, slots=True)
class _Int8Codec:
    """Per-block absmax scaling: q = round(x / scale), scale = absmax / 127.

    Layout: ``ceil(n / block)`` float32 scales, then ``n`` int8 values.
    """

    block: int
    name: str = "int8"

    def nbytes(self, n: int) -> int:
        return 4 * -(-n // self.block) + n

    def encode(self, x: np.ndarray) -> np.ndarray:
        n, block = x.size, self.block
        nblocks = -(-n // block)
        out = np.empty(self.nbytes(n), np.uint8)
        scales = out[: 4 * nblocks].view(np.float32)
        q = out[4 * nblocks :].view(np.int8)
        full = n - n % block
        # Whole blocks as a (blocks, block) matrix: broadcasting instead of np.repeat.
        for xs, qs, sc in self._parts(x, q, scales, full):
            np.max(np.abs(xs), axis=1, out=sc)
            sc /= 127.0
            inv = np.divide(1.0, sc, out=np.zeros_like(sc), where=sc > 0)
            qs[...] = np.rint(xs * inv[:, None])  # |values| <= 127: no saturation
        return out

    def _parts(
        self, x: np.ndarray, q: np.ndarray, scales: np.ndarray, full: int
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(values, quantized, scales) views for the whole blocks and the tail block."""
        block, n = self.block, x.size
        parts = []
        if full:
            parts.append(
                (x[:full].reshape(-1, block), q[:full].reshape(-1, block), scales[: full // block])
            )
        if full < n:
            parts.append((x[full:].reshape(1, -1), q[full:].reshape(1, -1), scales[-1:]))
        return parts

    def decode(self, data: Any, n: int) -> np.ndarray:
        block = self.block
        nblocks = -(-n // block)
        raw = np.frombuffer(data, np.uint8, self.nbytes(n))
        scales = raw[: 4 * nblocks].view(np.float32)
        q = raw[4 * nblocks :].view(np.int8)
        out = np.empty(n, np.float32)
        full = n - n % block
        if full:
            np.multiply(
                q[:full].reshape(-1, block),
                scales[: full // block, None],
                out=out[:full].reshape(-1, block),
            )
        if full < n:
            np.multiply(q[full:], scales[-1], out=out[full:])
        return out


def make_codec(wire_dtype: str, block: int = 256) -> WireCodec:
    """The codec for ``wire_dtype`` (float16, bfloat16 or int8 with ``block``-sized scales)."""
    if wire_dtype == "float16":
        return _CastCodec("float16", np.dtype(np.float16))
    if wire_dtype == "bfloat16":
        return _CastCodec("bfloat16", np.dtype(ml_dtypes.bfloat16))
    if wire_dtype == "int8":
        if not isinstance(block, int) or block < 1:
            raise UsageError(f"int8 block size must be a positive int, got {block!r}")
        return _Int8Codec(block)
    raise UsageError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")


class ErrorFeedback:
    """Keeps what compression lost from one call's input and adds it to the next call's.

    Use one per tensor: ``g.all_reduce(grad, wire_dtype="int8", error_feedback=ef)``.
    Over many steps the compression error then averages out instead of accumulating.
    """

    def __init__(self) -> None:
        self.residual: np.ndarray | None = None

    def apply(self, x: np.ndarray, codec: WireCodec) -> np.ndarray:
        """``decode(encode(x + residual))``, remembering the new residual."""
        target = x.astype(np.float32).reshape(-1)  # a fresh copy: updated in place below
        if self.residual is not None:
            if self.residual.shape != target.shape:
                raise UsageError(
                    f"error feedback holds a residual of {self.residual.size} elements, "
                    f"this call has {target.size}; use one ErrorFeedback per tensor"
                )
            target += self.residual
        sent = codec.decode(codec.encode(target), target.size)
        self.residual = np.subtract(target, sent, out=target)
        return sent
