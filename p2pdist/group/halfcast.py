"""float32 <-> IEEE float16 conversions, bit-identical to numpy's casts but faster.

numpy converts float32 to float16 one element at a time (about 1.5 GB/s of float32 on
the reference machine, slower than a loopback link). The routes here do the same
conversion with a handful of vectorised integer ufuncs over the bit patterns:

* encode (round to nearest, ties to even): for normal float16 results the classic
  "add 0xfff plus the lowest kept bit, then shift" rounding of the float32 bits, with the
  exponent rebiased in the same addition; zeros and subnormal results are rounded by the
  FPU itself (adding 0.5 puts the value's float16 subnormal step in float32's last
  place); blocks holding a value that rounds to infinity, an infinity or a NaN fall back
  to numpy's own cast.
* decode (exact): ``(bits & 0x7fff) << 13`` reinterpreted as float32 and multiplied by
  2**112 rebiases normal and subnormal values alike; blocks holding an infinity or a NaN
  fall back to numpy.

Both give exactly numpy's bits (tested over a sweep of the float32 range and every
float16). ``benchmarks/codecs.py`` measures them against numpy's casts.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HalfScratch", "decode_f16", "encode_f16", "subnormals_flushed"]

_U32 = np.uint32
_ABS = _U32(0x7FFFFFFF)
_SHIFT = _U32(13)
_ONE = _U32(1)
_ROUND = _U32((0xFFF - (112 << 23)) & 0xFFFFFFFF)
"""0xfff (just under half a float16 step) plus the exponent rebias 127 -> 15."""
_MIN_NORMAL = _U32(113 << 23)
"""2**-14, the smallest normal float16, as float32 bits."""
_MAX_FINITE = _U32(0x477FEFFF)
"""The largest float32 that still rounds to a finite float16 (65519.996...)."""
_HALF_BITS = _U32(0x3F000000)
_HALF = np.float32(0.5)
_SIGN_SHIFT = _U32(16)
_SIGN16 = _U32(0x8000)
_SIGN_BIT = _U32(15)
_SIGN_TO_F32 = _U32(31)
_MAGNITUDE16 = _U32(0x7FFF)
_DECODE_SCALE = np.float32(2.0**112)
_DECODE_INF = _U32(0x47800000)
"""65536.0: decoded magnitudes at or above it came from infinities or NaNs."""


class HalfScratch:
    """Two uint32 work arrays, grown on demand and reused across calls."""

    def __init__(self) -> None:
        self._a = np.empty(0, _U32)
        self._b = np.empty(0, _U32)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The two work arrays, ``n`` elements each (grown when smaller)."""
        if self._a.size < n:
            self._a = np.empty(n, _U32)
            self._b = np.empty(n, _U32)
        return self._a[:n], self._b[:n]


BLOCK = 1 << 16
"""Elements per cache-sized block (each ufunc pass then runs on 256 KiB, not memory)."""


def encode_f16(x: np.ndarray, out: np.ndarray, scratch: HalfScratch) -> None:
    """``out[...] = x.astype(float16)`` bit for bit; ``x`` float32, ``out`` 1-D uint16."""
    for s in range(0, x.size, BLOCK):
        _encode_block(x[s : s + BLOCK], out[s : s + BLOCK], scratch)


def decode_f16(h: np.ndarray, out: np.ndarray, scratch: HalfScratch) -> None:
    """``out[...] = h.view(float16).astype(float32)`` bit for bit; ``h`` 1-D uint16.

    A pure bit routine: its rebias multiplies float32 subnormals (float16 subnormals
    shifted into place), which a CPU that flushes them (FTZ/DAZ: -ffast-math libraries,
    torch.set_flush_denormal) reads as zero. Callers check :func:`subnormals_flushed`
    (the float16 codec does, once) and take numpy's exact cast when it is true.
    """
    for s in range(0, h.size, BLOCK):
        _decode_block(h[s : s + BLOCK], out[s : s + BLOCK], scratch)


_SMALLEST_SUBNORMAL = np.array([1e-45], np.float32)


def subnormals_flushed() -> bool:
    """Whether this thread's CPU now treats float32 subnormals as zero (DAZ/FTZ set),
    which a program can switch at any time; a probe costs about a microsecond."""
    return bool(np.multiply(_SMALLEST_SUBNORMAL, _DECODE_SCALE)[0] == 0)


def _encode_block(x: np.ndarray, out: np.ndarray, scratch: HalfScratch) -> None:
    n = x.size
    u = x.view(_U32)
    a, t = scratch.get(n)
    np.bitwise_and(u, _ABS, out=a)
    if a.max() > _MAX_FINITE:  # overflow to inf, inf or NaN: numpy's cast (rare)
        # inf is the documented result, and 0 for what is below float16's least
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            np.copyto(out.view(np.float16), x, casting="unsafe")
        return
    np.right_shift(a, _SHIFT, out=t)
    np.bitwise_and(t, _ONE, out=t)  # the lowest kept bit: ties go to even
    np.add(t, a, out=t)
    np.add(t, _ROUND, out=t)
    np.right_shift(t, _SHIFT, out=t)  # exponent and 10-bit significand, rounded
    if a.min() < _MIN_NORMAL:  # zeros and subnormal results: let the FPU round
        idx = np.flatnonzero(a < _MIN_NORMAL)
        small = a[idx].view(np.float32) + _HALF
        t[idx] = small.view(_U32) - _HALF_BITS
    np.right_shift(u, _SIGN_SHIFT, out=a)
    np.bitwise_and(a, _SIGN16, out=a)
    np.bitwise_or(t, a, out=t)
    np.copyto(out, t, casting="unsafe")  # the low 16 bits


def _decode_block(h: np.ndarray, out: np.ndarray, scratch: HalfScratch) -> None:
    n = h.size
    bits = out.view(_U32)
    np.copyto(bits, h, casting="unsafe")
    np.bitwise_and(bits, _MAGNITUDE16, out=bits)
    np.left_shift(bits, _SHIFT, out=bits)
    np.multiply(out, _DECODE_SCALE, out=out)  # rebias; exact, subnormals included
    if bits.max() >= _DECODE_INF:  # infinities and NaNs: numpy's cast (rare)
        np.copyto(out, h.view(np.float16))
        return
    s, _ = scratch.get(n)
    np.copyto(s, h, casting="unsafe")
    np.right_shift(s, _SIGN_BIT, out=s)
    np.left_shift(s, _SIGN_TO_F32, out=s)  # the sign, bit 15 -> bit 31
    np.bitwise_or(bits, s, out=bits)
