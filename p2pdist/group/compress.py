"""Wire codecs for compressed reductions: float16, bfloat16 (via ml_dtypes), int8 + scales.

A codec turns float32 values into the bytes a compressed collective sends and back.
Accumulation always happens in float32 on the receiving rank; only the wire is narrow.

Bytes on the wire per element: float16 and bfloat16 2; int8 1 + 4/block (one float32
absmax scale per block of ``block`` elements).

Every codec works in place: ``encode_into`` writes into a caller's buffer,
``decode_into`` into a caller's float32 array, and ``accumulate`` adds the decoded values
to an accumulator without a full-size temporary. A codec keeps a little scratch memory of
its own between calls (one codec per collective call; codec methods never await, so
sharing one between tasks is safe too). The conversion routes were chosen by measurement
(``benchmarks/codecs.py``): ml_dtypes for bfloat16, :mod:`.halfcast` (bit-identical to
numpy's cast, 2-3x faster) for float16.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import AsyncIterator
from functools import cache
from typing import Any, Protocol

import numpy as np

from ..errors import P2PTimeoutError, UsageError
from ..settings import check_int
from .halfcast import HalfScratch, decode_f16, encode_f16, subnormals_flushed

__all__ = [
    "F16_ROUTES",
    "INT8_BLOCK",
    "WIRE_DTYPES",
    "ErrorFeedback",
    "WireCodec",
    "WireDtype",
    "check_block",
    "divide_for_mean",
    "make_codec",
    "to_float32",
]

WIRE_DTYPES = ("float16", "bfloat16", "int8")

WireDtype = str | np.dtype[Any] | type[np.generic]
"""What ``wire_dtype=`` takes: a name of :data:`WIRE_DTYPES`, or its numpy dtype or
scalar type (``np.float16``, ``ml_dtypes.bfloat16``, ``np.dtype("int8")``)."""

F16_ROUTES = ("bits", "numpy")
"""float16 conversion routes: the vectorised bit route (default) or numpy's own cast."""

_F16 = np.dtype(np.float16)
_ABS_BITS = np.int32(0x7FFFFFFF)


def _sum_errors_documented() -> np.errstate:
    """For a wire's partial sums, whatever the caller's ``np.errstate``: a sum past
    float32's range is inf and +inf plus -inf is NaN, the documented results (an int8
    wire gives the same), not a FloatingPointError that would break the group, nor a
    warning. (An errstate is entered once: a fresh one per use.)"""
    return np.errstate(over="ignore", invalid="ignore")


class WireCodec(Protocol):
    """float32 <-> wire bytes for one compressed collective."""

    @property
    def name(self) -> str:
        """The wire dtype's name."""
        ...

    def nbytes(self, n: int) -> int:
        """Encoded size of ``n`` elements."""
        ...

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        """Encode float32 ``x`` (1-D) into ``out`` (uint8, ``nbytes(x.size)`` long)."""
        ...

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        """Decode ``out.size`` elements from ``data`` (bytes-like) into float32 ``out``."""
        ...

    def accumulate(self, data: Any, acc: np.ndarray) -> None:
        """``acc += decode(data)`` in float32, for ``acc.size`` elements."""
        ...

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Encode float32 ``x`` (1-D) into a new uint8 array of ``nbytes(x.size)``."""
        ...

    def decode(self, data: Any, n: int) -> np.ndarray:
        """Decode ``n`` elements from ``data`` (bytes-like) into a new float32 array."""
        ...

    @property
    def align(self) -> int:
        """Elements per independently encoded unit (int8: the block; 1 otherwise): a
        piece that starts at a multiple of it encodes as that piece of the whole does."""
        ...


class _Codec:
    """``encode``/``decode`` on top of the in-place methods."""

    __slots__ = ()

    def nbytes(self, n: int) -> int:
        raise NotImplementedError

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        raise NotImplementedError

    def encode(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(self.nbytes(x.size), np.uint8)
        self.encode_into(x, out)
        return out

    def decode(self, data: Any, n: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        self.decode_into(data, out)
        return out

    @property
    def align(self) -> int:
        return 1


@cache
def _bf16() -> np.dtype[Any]:
    """ml_dtypes' bfloat16, imported on first use: the import takes most of a second,
    which every process that imports p2pdist (ranks, the relay, the CLI) would pay."""
    import ml_dtypes

    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


class _Bf16Codec(_Codec):
    """bfloat16 through ml_dtypes' casts (round to nearest even)."""

    __slots__ = ("_dtype",)
    name = "bfloat16"

    def __init__(self) -> None:
        self._dtype = _bf16()

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out.view(self._dtype), x, casting="unsafe")  # bfloat16 exports no buffer format

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        np.copyto(out, np.frombuffer(data, self._dtype, out.size))

    def accumulate(self, data: Any, acc: np.ndarray) -> None:
        # A mixed-dtype ufunc casts in small buffered blocks: no full-size temporary.
        with _sum_errors_documented():
            np.add(acc, np.frombuffer(data, self._dtype, acc.size), out=acc)


class _F16Codec(_Codec):
    """IEEE float16: the bit route of :mod:`.halfcast`, or numpy's cast (same bits)."""

    __slots__ = ("_acc", "_flushed", "_route", "_scratch")
    name = "float16"

    def __init__(self, route: str = "bits") -> None:
        if route not in F16_ROUTES:
            raise UsageError(f"float16 route must be one of {F16_ROUTES}, got {route!r}")
        self._route = route
        self._scratch = HalfScratch()
        self._acc = np.empty(0, np.float32)
        self._flushed: bool | None = None
        """Whether the CPU flushes subnormals (FTZ/DAZ), probed at the first decode: the
        bit route's decode would read float16 subnormals as zero there, numpy's is exact.
        A codec lives for one all_reduce call (make_codec), so that is once per call."""

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        if self._route == "bits":
            encode_f16(x, out.view(np.uint16), self._scratch)
        else:
            # inf is the documented result, and 0 for what is below float16's least
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                np.copyto(out.view(_F16), x, casting="unsafe")

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        if self._route == "bits" and self._flushed is None:
            self._flushed = subnormals_flushed()
        if self._route == "bits" and not self._flushed:
            decode_f16(np.frombuffer(data, np.uint16, out.size), out, self._scratch)
        else:
            np.copyto(out, np.frombuffer(data, _F16, out.size))

    def accumulate(self, data: Any, acc: np.ndarray) -> None:
        if self._route != "bits":
            with _sum_errors_documented():
                np.add(acc, np.frombuffer(data, _F16, acc.size), out=acc)
            return
        if self._acc.size < acc.size:
            self._acc = np.empty(acc.size, np.float32)
        tmp = self._acc[: acc.size]
        self.decode_into(data, tmp)
        with _sum_errors_documented():
            np.add(acc, tmp, out=acc)


class _Int8Codec(_Codec):
    """Per-block absmax scaling: q = rint(x / scale), scale = absmax / 127.

    Layout: ``ceil(n / block)`` float32 scales, then ``n`` int8 values. Whole blocks are
    handled as a (blocks, block) matrix, a cache-sized slab of rows at a time, with
    scratch kept between calls.

    Two kinds of block take a slower exact route (:meth:`_encode_rare`, all such blocks
    of a slab in one vectorised batch), found from the per-block absmax at almost no
    cost: blocks whose absmax is below ``2**-96`` (there ``1 / scale`` would overflow
    float32, so they divide by the scale and clip), and blocks holding an infinity or
    NaN. Such a block's scale covers its finite values only; its non-finite elements are
    sent as -128 (a code absmax scaling never makes) and decode to NaN, and its scale is
    sent negated (sign bit set) so that the decoder only looks for -128 in the blocks
    that have it. The other values of the block are kept.
    """

    __slots__ = ("_inv", "_tmp", "block")
    name = "int8"
    _SLAB = 1 << 18
    """Elements per slab (1 MiB of float32)."""
    _TINY_BITS = np.int32(0x0F800000)
    """Bit pattern of 2**-96: blocks with a smaller (nonzero) absmax take the rare route."""
    _HUGE_BITS = np.int32(0x7F000000)
    """Bit pattern of 2**127: blocks with an absmax from it on take the rare route, whose
    scale is capped (:data:`_MAX_SCALE`) so that 127 x scale stays finite."""
    _MAX_SCALE = np.nextafter(np.float32(np.finfo(np.float32).max / 127), np.float32(0))
    _NONFINITE = -128

    def __init__(self, block: int) -> None:
        self.block = block
        self._tmp = np.empty(0, np.float32)
        self._inv = np.empty(0, np.float32)

    def nbytes(self, n: int) -> int:
        return 4 * -(-n // self.block) + n

    @property
    def align(self) -> int:
        return self.block

    def _slabs(self, n: int) -> list[tuple[int, int]]:
        """[start, end) element ranges: whole-block slabs, then the partial tail block."""
        block = self.block
        full = n - n % block
        step = max(block, self._SLAB - self._SLAB % block)
        parts = [(s, min(s + step, full)) for s in range(0, full, step)]
        if full < n:
            parts.append((full, n))
        return parts

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        # One slab at most (see _slabs), and never more than n: a block far larger than
        # the array (one scale for all of it) needs no block-sized scratch.
        size = min(n, max(self.block, self._SLAB - self._SLAB % self.block))
        if self._tmp.size < size:
            self._tmp = np.empty(size, np.float32)
            self._inv = np.empty(-(-size // self.block), np.float32)
        return self._tmp, self._inv

    def _split(self, raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        nblocks = -(-n // self.block)
        return raw[: 4 * nblocks].view(np.float32), raw[4 * nblocks :].view(np.int8)

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        n, block = x.size, self.block
        scales, q = self._split(out, n)
        tmp_all, inv_all = self._scratch(n)
        for s0, s1 in self._slabs(n):
            width = min(block, s1 - s0)
            rows = (s1 - s0) // width
            xs = x[s0:s1].reshape(rows, width)
            tmp = tmp_all[: s1 - s0].reshape(rows, width)
            sc = scales[s0 // block : s0 // block + rows]
            qs = q[s0:s1].reshape(rows, width)
            inv = inv_all[:rows]
            # absmax per block on the bit patterns: |x| as int32 orders like the floats
            # and numpy's integer max is about twice as fast as its float max.
            bits = tmp.view(np.int32)
            np.bitwise_and(xs.view(np.int32), _ABS_BITS, out=bits)
            top = sc.view(np.int32)
            np.max(bits, axis=1, out=top)
            rare = (top >= self._HUGE_BITS) | ((top > 0) & (top < self._TINY_BITS))
            any_rare = bool(rare.any())
            if any_rare:
                top[rare] = 0  # scale 0 below; the rows are encoded again afterwards
            sc /= np.float32(127.0)
            inv.fill(0.0)
            np.divide(np.float32(1.0), sc, out=inv, where=sc > 0)
            # inf * 0 in a rare row, and elements far below their block's absmax that
            # scale to below float32's smallest: no warning (nor FloatingPointError
            # under the caller's np.errstate(all="raise")); they round to 0 as they should
            with np.errstate(invalid="ignore", under="ignore"):
                np.multiply(xs, inv[:, None], out=tmp)
                np.rint(tmp, out=tmp)  # |values| <= 127: no saturation
                np.copyto(qs, tmp, casting="unsafe")
            if any_rare:
                rows_rare = np.flatnonzero(rare)
                q_rare, sc[rows_rare] = self._encode_rare(xs[rows_rare])
                qs[rows_rare] = q_rare

    def _encode_rare(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encode blocks (the rows of ``x``) with a tiny or non-finite absmax exactly, all
        at once; returns their int8 values and scales (a scale is negated where its block
        holds non-finite values, see the class docstring)."""
        with np.errstate(under="ignore"):  # tiny blocks underflow on purpose
            finite = np.isfinite(x)
            vals = np.where(finite, x, np.float32(0.0))
            amax = np.abs(vals).max(axis=1)
            scale = amax / np.float32(127.0)
            # A subnormal scale rounded down would map the absmax past 127: round it up.
            ratio = np.divide(amax, scale, out=np.zeros_like(amax), where=scale > 0)
            low = (amax > 0) & ((scale == 0) | (ratio > 127))
            scale[low] = np.nextafter(scale[low], np.float32(np.inf))
            # Near float32's limit, 127 x (absmax / 127) rounds past it: cap the scale
            # (the clip below keeps the codes within 127).
            np.minimum(scale, self._MAX_SCALE, out=scale)
            # Division, not a reciprocal: 1 / scale overflows for tiny scales, and a
            # subnormal scale is inexact enough to need the clip. A zero scale goes with
            # an all-zero block: divide by 1 instead.
            np.divide(vals, np.where(scale > 0, scale, np.float32(1.0))[:, None], out=vals)
            np.rint(vals, out=vals)
            np.clip(vals, -127, 127, out=vals)
            q = vals.astype(np.int8)
            q[~finite] = self._NONFINITE
            return q, np.where(finite.all(axis=1), scale, -scale)

    def _decode_slabs(self, data: Any, out: np.ndarray, add: bool) -> None:
        n, block = out.size, self.block
        scales, q = self._split(np.frombuffer(data, np.uint8, self.nbytes(n)), n)
        tmp_all, _ = self._scratch(n)
        for s0, s1 in self._slabs(n):
            width = min(block, s1 - s0)
            rows = (s1 - s0) // width
            qs = q[s0:s1].reshape(rows, width)
            sc = scales[s0 // block : s0 // block + rows, None]
            dst = out[s0:s1].reshape(rows, width)
            flagged = np.signbit(sc[:, 0])
            tmp = tmp_all[: s1 - s0].reshape(rows, width) if add else dst
            np.multiply(qs, sc, out=tmp)  # finite: 127 x scale stays within float32
            if flagged.any():  # blocks with non-finite values (see the class docstring)
                rows_flagged = np.flatnonzero(flagged)
                q_flagged = qs[rows_flagged]
                vals = q_flagged * -sc[rows_flagged]
                vals[q_flagged == self._NONFINITE] = np.nan
                tmp[rows_flagged] = vals
            if add:
                # A sum past float32's range is inf, as in float32 itself: not an error
                # under a caller's np.errstate(over="raise").
                with np.errstate(over="ignore"):
                    np.add(dst, tmp, out=dst)

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        self._decode_slabs(data, out, add=False)

    def accumulate(self, data: Any, acc: np.ndarray) -> None:
        self._decode_slabs(data, acc, add=True)


INT8_BLOCK = 256
"""Elements per int8 scale when a call names no ``block``."""


def to_float32(x: np.ndarray) -> np.ndarray:
    """``x`` flattened into a fresh float32 array, the values a compressed reduction
    starts from: float64 values beyond float32's range become inf or 0 as the cast
    makes them, whatever the caller's ``np.errstate`` (raising there would fail this
    rank alone, before the collective, and leave the others waiting)."""
    with np.errstate(over="ignore", under="ignore"):
        return x.reshape(-1).astype(np.float32)


def check_block(block: object) -> int:
    """``block`` as an int of at least 1, else a :class:`UsageError`: checked whatever the
    wire (only int8 uses it, but a bad one is a mistake on every call)."""
    return check_int("int8 block size", block, 1)


def make_codec(
    wire_dtype: WireDtype, block: int = INT8_BLOCK, *, f16_route: str = "bits"
) -> WireCodec:
    """The codec for ``wire_dtype`` (float16, bfloat16 or int8 with ``block``-sized scales).

    ``f16_route`` picks the float16 conversion ("bits" or "numpy"; identical results).
    """
    block = check_block(block)
    name = wire_dtype if isinstance(wire_dtype, str) else None
    if isinstance(wire_dtype, np.dtype) or (
        isinstance(wire_dtype, type) and issubclass(wire_dtype, np.generic)
    ):
        dtype = np.dtype(wire_dtype)
        name = dtype.name if dtype.isnative else None  # (">f2" is no wire dtype)
    if name == "float16":
        return _F16Codec(f16_route)
    if name == "bfloat16":
        return _Bf16Codec()
    if name == "int8":
        return _Int8Codec(block)
    raise UsageError(
        f"wire_dtype must be one of {WIRE_DTYPES} (or its numpy type), got {wire_dtype!r}"
    )


def divide_for_mean(x: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """``out[...] = x / divisor`` in float32 (a compressed mean divides by the world
    before encoding); an underflow of tiny inputs to subnormals or zero is expected."""
    with np.errstate(under="ignore"):
        np.divide(x, np.float32(divisor), out=out)


_LEAST_LEFT = 1e-3
"""Seconds a call whose turn came at its deadline still gets (a timeout must be > 0)."""


class ErrorFeedback:
    """Keeps what compression lost from one call's input and adds it to the next call's.

    Use one per tensor: ``g.all_reduce(grad, wire_dtype="int8", error_feedback=ef)``
    (or ``reduce_scatter``, for gradients sharded across ranks). Over many steps the
    compression error then averages out instead of accumulating.

    The residual is kept in the units that travel: the input's, or the input's divided by
    the world for ``op="mean"`` (which scales before encoding); a call with another scale
    converts it. Where the value to send or its decoded form is not finite (an inf or NaN
    in the input, or a float16 overflow), and where the call's result is not finite (a
    sum past the wire's, float32's or the input dtype's range), the residual keeps the
    value it had before the call: one bad step costs that step's result, and later
    finite inputs give finite results again. A call that fails or is cancelled once it
    began (a timeout, a lost peer) leaves the residual as it found it: its step never
    reached the sum, so a step repeated after recovering carries what the earlier ones
    lost.

    One ErrorFeedback serves one call at a time: a collective holds it from when it runs
    until it ends, and the calls made with it take their turns in the order they were
    made (the order every rank pairs its calls in), whatever order they start in: a
    second call made while the first is in flight waits for it, and its input joins the
    residual the first left, as if the caller had awaited the first. That order is this
    rank's: use one ErrorFeedback with one group's calls (a sub-group's calls and its
    parent's pair independently, so another rank may make them in the other order).
    """

    _PIECE = 1 << 18
    """Elements encoded at a time (a multiple of the int8 block): no full-size wire copy."""

    def __init__(self) -> None:
        self.residual: np.ndarray | None = None
        self._divisor = 1
        self._before: np.ndarray | None = None
        """The residual as the running call found it (in its units), until the call
        ends: what :meth:`settle` rolls back to where the sum is not finite, and what
        the residual goes back to when the call fails."""
        self._held: int | None = None
        """The size of the call that holds this feedback (:meth:`hold`), or None."""
        self._tickets: list[int] = []
        """The call-order numbers of the calls made with this feedback that have not
        ended, smallest first (taken when each call is made: calls.py): whose turn."""
        self._holder: int | None = None
        """The call-order number of the call that holds it (-1: a call with none)."""
        self._changed: list[asyncio.Future[None]] = []
        """Calls waiting for their turn, woken when a call ends."""

    def begin(self, x: np.ndarray, divisor: int = 1) -> np.ndarray:
        """``x / divisor + residual`` as a new flat float32 array, with the residual back
        at zero: the call's own encodings then add what they lose to it (reduce_scatter,
        whose ring encodes every piece of the input but this rank's own, which it never
        encodes).

        No :meth:`settle` follows: an encoding whose loss is not finite adds nothing, and
        the sums of the other ranks' pieces, which this rank never learns, cannot say
        where to roll back. (So where another rank's sum overflowed, the finite loss of
        this rank's encoding of that element is carried on, unlike all_reduce's.)"""
        sent, residual = self._start(x, divisor)
        sent += residual
        # The old residual is kept whole (for a failure) and a zeroed one takes its place.
        self._before, self.residual = residual, np.zeros_like(residual)
        return sent

    def check(self, size: int) -> None:
        """A :class:`UsageError` unless a call of ``size`` elements may use this feedback
        (one ErrorFeedback per tensor): the size of its residual, or of the call that
        holds it while that has made none yet."""
        held = self.residual.size if self.residual is not None else self._held
        if held is not None and held != size:
            raise UsageError(
                f"error feedback holds a residual of {held} elements, "
                f"this call has {size}; use one ErrorFeedback per tensor"
            )

    def take_ticket(self, order: int) -> None:
        """A call numbered ``order`` in the group's call order is made with this feedback:
        it takes its turn after the calls made before it (:meth:`hold`)."""
        bisect.insort(self._tickets, order)

    async def hold(self, size: int, order: int, timeout: float) -> None:
        """Take this feedback for the call numbered ``order`` (-1: a call that took no
        ticket), of ``size`` elements, once the calls made before it with this feedback
        have ended, waiting at most ``timeout`` seconds; then check it (:meth:`check`)
        before the call takes its channel. A :class:`UsageError` holds nothing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._turn_of(order):
            waiter = loop.create_future()
            self._changed.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                if self._holder is not None:
                    why = (
                        "that one is still running (this call's timeout bounds its wait "
                        "for its turn and its own run together)"
                    )
                else:
                    why = (
                        "that one has not started (await it, or start it as a task, "
                        "before awaiting this one; or it is a call of another group, a "
                        "sub-group or its parent, which another rank made in the other "
                        "order: use one ErrorFeedback per group)"
                    )
                raise P2PTimeoutError(
                    f"a call made with an ErrorFeedback waited {timeout:g} s for the call "
                    f"made before it with the same feedback to end: {why}"
                ) from None
        self._holder = order
        try:
            self.check(size)
        except BaseException:
            self.end(order)
            raise
        self._held = size

    @contextlib.asynccontextmanager
    async def turn(self, size: int, order: int, timeout: float) -> AsyncIterator[float]:
        """The call numbered ``order`` holds this feedback inside (:meth:`hold`), and
        ends its turn on the way out (:meth:`end`), however it leaves. Gives what is left
        of ``timeout`` after the wait, for the call itself (one bound for both)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self.hold(size, order, timeout)
        try:
            yield max(deadline - loop.time(), _LEAST_LEFT)
        except BaseException:
            self._roll_back()
            raise
        finally:
            self.end(order)

    def _turn_of(self, order: int) -> bool:
        if self._holder is not None:
            return False
        if order < 0:  # (a call without a ticket goes when no ticketed call waits)
            return not self._tickets
        return bool(self._tickets) and self._tickets[0] == order

    def end(self, order: int) -> None:
        """The call numbered ``order`` ended (returned, failed, cancelled, or never ran):
        it gives its turn up, or the feedback back; idempotent."""
        if order in self._tickets:
            self._tickets.remove(order)
        if self._holder == order:
            self._holder = self._held = self._before = None  # (a failed call's snapshot)
        waiting, self._changed = self._changed, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _roll_back(self) -> None:
        """The running call failed: the residual goes back to what it found."""
        before = self._before
        if before is not None and self.residual is not None and before.shape == self.residual.shape:
            self.residual = before

    def _start(self, x: np.ndarray, divisor: int) -> tuple[np.ndarray, np.ndarray]:
        """``x / divisor`` as a new flat float32 array, and the residual in those units
        (made, checked against ``x``'s size, or rescaled)."""
        sent = to_float32(x)  # a fresh copy: the caller works in place
        if divisor != 1:
            divide_for_mean(sent, divisor, sent)
        self.check(sent.size)
        if self.residual is None:
            self.residual = np.zeros_like(sent)
        elif divisor != self._divisor:
            with np.errstate(under="ignore"):  # a tiny residual rounds to 0, as it should
                self.residual *= np.float32(self._divisor / divisor)
        self._divisor = divisor
        return sent, self.residual

    def apply(self, x: np.ndarray, codec: WireCodec, divisor: int = 1) -> np.ndarray:
        """``decode(encode(x / divisor + residual))``, remembering the new residual.

        Returns a new float32 array; the residual is updated in its own array, piece by
        piece, through one piece-sized wire buffer, float32 scratch and bool scratch. A
        piece that decodes to finite values (the usual case) takes a plain subtraction.
        """
        sent, residual = self._start(x, divisor)
        self._before = residual.copy()  # for settle
        sent += residual  # the value to send: x + what earlier calls lost
        align = codec.align  # int8 scales cover whole blocks
        step = max(1, self._PIECE // align) * align
        piece = min(step, sent.size)
        wire = np.empty(codec.nbytes(piece), np.uint8)
        decoded = np.empty(piece, np.float32)
        finite = np.empty(piece, np.bool_)
        for a in range(0, sent.size, step):
            b = min(a + step, sent.size)
            buf, dec, ok = wire[: codec.nbytes(b - a)], decoded[: b - a], finite[: b - a]
            codec.encode_into(sent[a:b], buf)
            codec.decode_into(buf, dec)
            # Every codec decodes a non-finite value to a non-finite one, so a finite
            # decoded piece means a finite residual: the plain subtraction (the usual case).
            if np.isfinite(dec, out=ok).all():
                np.subtract(sent[a:b], dec, out=residual[a:b])
            else:
                self._keep_finite(sent[a:b], dec, residual[a:b])
            np.copyto(sent[a:b], dec)
        return sent

    def settle(self, result: np.ndarray) -> None:
        """End the call :meth:`apply` began, given its ``result`` (in the caller's dtype,
        where a float32 sum can still overflow): where that is not finite, the residual
        goes back to what it was before the call. (Each
        rank's residual holds what its own encodings lost; where the sum overflowed, the
        step is lost anyway, and carrying that loss forward would add a large finite
        error to the next steps' results.)"""
        before = self._before
        if before is None or self.residual is None or before.shape != self.residual.shape:
            return
        ok = np.isfinite(result.reshape(-1))
        if not ok.all():
            np.copyto(self.residual, before, where=~ok)

    @staticmethod
    def _keep_finite(sent: np.ndarray, dec: np.ndarray, residual: np.ndarray) -> None:
        """``residual = sent - dec`` where that is finite; the previous residual elsewhere."""
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: masked below
            diff = sent - dec
        np.copyto(residual, diff, where=np.isfinite(diff))
